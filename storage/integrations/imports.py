"""``ckptflow import``: a checkpoint made by another tool, committed as a version of a store.

What it reads, by what the source is:

- a **safetensors** file: its tensors, flat, as safetensors keys them;
- a **torch.save** file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``): with ``torch.load(weights_only=True)``,
  which rebuilds tensors, containers and plain values and runs no code, allowing besides them
  only the values :mod:`..format.pyvalues` stores (namespaces, paths: a Lightning checkpoint's
  hyper-parameters, kept as the Lightning plugin keeps them); a file that needs more (a pickled
  class) is refused: ckptflow never unpickles;
- a **Hugging Face** directory (``config.json`` or ``*.safetensors`` in it: a model saved with
  ``save_pretrained``, or a Trainer's ``checkpoint-N``): as the Trainer callback stores one
  (:mod:`.hf`), so ``ckptflow restore --format hf`` and ``restore_trainer_checkpoint`` give it back;
- a **DCP** directory (a ``.metadata`` file, what ``FileSystemWriter`` writes) is refused: DCP's
  metadata is a pickle. The message names DCP's own converter, to run where the directory is
  trusted, whose torch.save file this then imports.

The epoch and step default to what the source records (Lightning's ``epoch`` and
``global_step``, a Trainer state's), and the version notes where it came from (``user``:
``imported_from``, ``import_kind``).
"""

from __future__ import annotations

import json
import math
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError

if TYPE_CHECKING:
    from ..info import VersionInfo
    from ..store import CheckpointStore

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def source_kind(source: Path) -> str:
    """``"safetensors"``, ``"torch"``, ``"hf"`` or ``"dcp"``; CheckpointError for anything else."""
    if source.is_dir():
        if (source / ".metadata").is_file():
            return "dcp"
        if (source / "config.json").is_file() or any(source.glob("*.safetensors")):
            return "hf"
        raise CheckpointError(
            f"{source} is a directory with neither DCP's .metadata nor a config.json or *.safetensors "
            "file: import reads a DCP checkpoint, a Hugging Face directory, or one file"
        )
    if not source.is_file():
        raise CheckpointError(f"{source} does not exist: give a checkpoint file or directory")
    if source.suffix == ".safetensors":
        return "safetensors"
    if source.suffix in TORCH_SUFFIXES:
        return "torch"
    raise CheckpointError(
        f"{source}: import reads *.safetensors, torch.save files ({', '.join(TORCH_SUFFIXES)}), "
        "a Hugging Face directory or a DCP directory"
    )


@dataclass
class Imported:
    """A checkpoint read for an import, all of it checked, nothing written yet."""

    state: Any
    epoch: int | None
    step: int | None
    user: dict[str, Any]
    skipped: list[str] = field(default_factory=list)  # one line per entry of a directory not stored


def read_import(
    source: str | os.PathLike[str], *, epoch: int | None = None, step: int | None = None
) -> Imported:
    """Read and check the checkpoint at ``source`` (see the module note): a file or directory that
    cannot be imported is refused here, before any store is touched."""
    path = Path(source)
    kind = source_kind(path)
    skipped: list[str] = []
    state, facts = _read(path, kind, skipped)
    epoch = epoch if epoch is not None else _known(facts.get("epoch"))
    step = step if step is not None else _known(facts.get("step"))
    user = {"imported_from": str(path.absolute()), "import_kind": kind}
    return Imported(state, epoch, step, user, skipped)


def import_checkpoint(
    store: CheckpointStore,
    source: str | os.PathLike[str],
    *,
    epoch: int | None = None,
    step: int | None = None,
) -> VersionInfo:
    """Commit the checkpoint at ``source`` as a new version of ``store`` (see the module note)."""
    found = read_import(source, epoch=epoch, step=step)
    return store.save(found.state, epoch=found.epoch, step=found.step, user=found.user)


def _check_indexes(path: Path, files: list[dict[str, Any]], kept: set[str]) -> None:
    """Refuse a Hugging Face directory whose shard index (``*.index.json``) names a file outside it
    or one it does not hold: ``from_pretrained`` would fail on what the import committed."""
    from .hfdir import file_name_problem

    for entry in files:
        name = entry["path"]
        if not name.endswith(".index.json") or entry["kind"] != "bytes":
            continue
        where = f"{path / name}"
        try:
            index = json.loads(bytes(entry["value"].numpy()))
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{where} is not valid JSON: {' '.join(str(exc).split())[:200]}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{where} has no weight_map: not a shard index of save_pretrained")
        for shard in sorted({json.dumps(v) if not isinstance(v, str) else v for v in weight_map.values()}):
            rel = posixpath.normpath(posixpath.join(posixpath.dirname(name), shard))
            if shard.startswith("/") or rel.startswith("../") or file_name_problem(rel):
                raise CheckpointError(
                    f"{where} names the shard {shard!r}, outside the directory: import reads only what "
                    "the directory holds"
                )
            if rel not in kept:
                raise CheckpointError(
                    f"{where} names the shard {shard!r}, which {path} does not hold (or only as a link "
                    "out of it): the checkpoint is incomplete; copy the shard in, or import another one"
                )


def _known(fact: int | CheckpointError | None) -> int | None:
    if isinstance(fact, CheckpointError):
        raise fact
    return fact


def _read(path: Path, kind: str, skipped: list[str]) -> tuple[Any, dict[str, int | CheckpointError]]:
    if kind == "safetensors":
        from ..load.foreign import read_safetensors

        return read_safetensors(path), {}
    if kind == "torch":
        return _torch_file(path)
    if kind == "hf":
        try:
            from .hf import read_checkpoint_dir
        except ImportError as exc:
            raise CheckpointError(
                f"importing a Hugging Face directory needs {exc.name}: pip install 'ckptflow[hf]'"
            ) from None
        from .hfdir import KEY

        saved = read_checkpoint_dir(path, skipped)
        kept = {f["path"] for f in saved["files"]}
        _check_indexes(path, saved["files"], kept)
        left = sorted(  # torch files that hold more than tensors (the Trainer's pickled arguments aside)
            p.relative_to(path).as_posix()
            for p in path.rglob("*")
            if p.suffix in TORCH_SUFFIXES and p.is_file() and p.name != "training_args.bin"
        )
        if [name for name in left if name not in kept]:
            raise CheckpointError(
                f"{path}: {', '.join(n for n in left if n not in kept)} hold more than tensors and plain "
                "values, which import reads only as tensors (ckptflow never unpickles): save the model "
                "with save_pretrained(safe_serialization=True) (safetensors)"
            )
        return {KEY: saved}, _trainer_facts(path)
    raise CheckpointError(
        f"{path} is a DCP checkpoint, whose .metadata is a pickle, which ckptflow never reads (it would "
        "run whatever code it holds). Where you trust it, convert it with DCP's own tool: python -m "
        f"torch.distributed.checkpoint.format_utils dcp_to_torch {path} state.pt; then import state.pt"
    )


def _torch_file(path: Path) -> tuple[Any, dict[str, int | CheckpointError]]:
    from ..format.pyvalues import to_storable
    from ..load.foreign import read_torch_file
    from .pointers import lightning_pointer

    try:
        pointer = lightning_pointer(str(path), {})
    except CheckpointError:
        pointer = None  # no pointer: a checkpoint file of its own
    if pointer is not None:
        raise CheckpointError(
            f"{path} is a pointer of ckptflow's Lightning plugin: its checkpoint is version "
            f"{pointer.version} of {pointer.store_url} already (ckptflow show {path})"
        )
    value = read_torch_file(path)
    facts: dict[str, int | CheckpointError] = {}
    if isinstance(value, dict):
        for key, fact in (("epoch", "epoch"), ("global_step", "step")):
            if key in value:
                facts[fact] = _fact(value[key], f"{path}'s {key}", fact)
    return to_storable(value, omit_under=("hyper_parameters", "datamodule_hyper_parameters")), facts


def _trainer_facts(path: Path) -> dict[str, int | CheckpointError]:
    """A Trainer checkpoint's epoch and step, from its ``trainer_state.json``: refused, naming the
    field, when it holds something that is no epoch or step (``--epoch``/``--step`` say them instead)."""
    state_file = path / "trainer_state.json"
    if not state_file.is_file():
        return {}
    where = str(state_file)
    try:
        with state_file.open("rb") as f:
            data = f.read(MAX_STATE_BYTES + 1)
        if len(data) > MAX_STATE_BYTES:
            raise CheckpointError(f"{where} is more than {MAX_STATE_BYTES:,} bytes: not a Trainer's state")
        state = json.loads(data)
    except OSError as exc:
        raise CheckpointError(f"cannot read {where}: {exc.strerror or exc}") from None
    except RecursionError:
        raise CheckpointError(f"{where} is nested too deeply to be a Trainer's state") from None
    except ValueError as exc:
        raise CheckpointError(f"{where} is not valid JSON: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{where} holds a JSON {type(state).__name__}, not a Trainer's state (an object)"
        )
    facts: dict[str, int | CheckpointError] = {}
    if "global_step" in state:
        facts["step"] = _fact(state["global_step"], f"{where}'s global_step", "step")
    if "epoch" in state:
        epoch = state["epoch"]
        if isinstance(epoch, float) and math.isfinite(epoch) and epoch >= 0:
            epoch = int(epoch)  # a Trainer's epoch counts fractions of epochs
        facts["epoch"] = _fact(epoch, f"{where}'s epoch", "epoch")
    return facts


MAX_STATE_BYTES = 64 << 20  # a trainer_state.json (its log history grows with the run)
LIMITS = {"epoch": 10**9, "step": (1 << 63) - 1}  # as a save takes them


def _fact(value: Any, what: str, fact: str) -> int | CheckpointError:
    """An epoch or step a source records, checked: a whole number in the range a save takes; else
    the error to raise if the import needs it (``--epoch``/``--step`` given, it does not)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= LIMITS[fact]:
        shown = repr(value) if isinstance(value, float) else json.dumps(value)[:40]
        return CheckpointError(
            f"{what} is {shown}, not a {fact} (a whole number from 0 to {LIMITS[fact]:,}): give "
            f"--{fact} to import it with one of your own"
        )
    return value
