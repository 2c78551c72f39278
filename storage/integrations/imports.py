"""``ckptflow import``: a checkpoint made by another tool, committed as a version of a store.

What it reads, by what the source is:

- a **safetensors** file: its tensors, flat, as safetensors keys them;
- a **torch.save** file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``): with ``torch.load(weights_only=True)``,
  which rebuilds tensors, containers and plain values and runs no code, allowing besides them
  only the values :mod:`.pyvalues` stores (namespaces, paths: a Lightning checkpoint's
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
import os
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


def import_checkpoint(
    store: CheckpointStore,
    source: str | os.PathLike[str],
    *,
    epoch: int | None = None,
    step: int | None = None,
) -> VersionInfo:
    """Commit the checkpoint at ``source`` as a new version of ``store`` (see the module note)."""
    path = Path(source)
    kind = source_kind(path)
    state, facts = _read(path, kind)
    epoch = epoch if epoch is not None else facts.get("epoch")
    step = step if step is not None else facts.get("step")
    user = {"imported_from": str(path.absolute()), "import_kind": kind}
    return store.save(state, epoch=epoch, step=step, user=user)


def _read(path: Path, kind: str) -> tuple[Any, dict[str, int]]:
    if kind == "safetensors":
        from safetensors.torch import load_file

        return load_file(path), {}
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

        saved = read_checkpoint_dir(path)
        kept = {f["path"] for f in saved["files"]}
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


def _torch_file(path: Path) -> tuple[Any, dict[str, int]]:
    import pickle

    import torch

    from .pointers import lightning_pointer
    from .pyvalues import SAFE_CLASSES, to_storable

    try:
        pointer = lightning_pointer(str(path), {})
    except CheckpointError:
        pointer = None  # no pointer: a checkpoint file of its own
    if pointer is not None:
        raise CheckpointError(
            f"{path} is a pointer of ckptflow's Lightning plugin: its checkpoint is version "
            f"{pointer.version} of {pointer.store_url} already (ckptflow show {path})"
        )
    try:
        with torch.serialization.safe_globals(list(SAFE_CLASSES)):
            value = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path} holds more than tensors and plain values ({first[:200]}), and ckptflow never "
            "unpickles (it would run the code the file holds): save the state as tensors, numbers, "
            "strings and containers (a state_dict), or as safetensors"
        ) from None
    facts = {}
    if isinstance(value, dict):
        for key, fact in (("epoch", "epoch"), ("global_step", "step")):
            if isinstance(value.get(key), int) and value[key] >= 0:
                facts[fact] = value[key]
    return to_storable(value, omit_under=("hyper_parameters", "datamodule_hyper_parameters")), facts


def _trainer_facts(path: Path) -> dict[str, int]:
    """A Trainer checkpoint's epoch and step, from its ``trainer_state.json``."""
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}
    facts = {}
    if isinstance(state.get("global_step"), int):
        facts["step"] = state["global_step"]
    if isinstance(state.get("epoch"), (int, float)):
        facts["epoch"] = int(state["epoch"])
    return facts
