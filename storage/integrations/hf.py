"""Hugging Face Trainer checkpoints in a ckptflow store: a ``TrainerCallback``, and the restore
that resumes from the store.

    callback = CkptflowCallback("s3://bucket/run1")
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    start = restore_trainer_checkpoint("s3://bucket/run1", args.output_dir)   # None: a new run
    # resume_only=True: a store with nothing committed (a mistyped URL) raises instead
    trainer.train(resume_from_checkpoint=start)

The Trainer writes ``checkpoint-N/`` to its output directory file by file, with nothing to
tell a finished directory from one a crash cut short, and on one machine's disk. After each
such save, the callback commits the directory into the store as one version, so the store
holds only whole checkpoints, with checksums, on any fsspec URL (and the store's archives,
uploads and retention apply). :func:`restore_trainer_checkpoint` writes a committed version
back as a ``checkpoint-N`` directory the Trainer resumes from, appearing whole or not at all.

The store rotates as the Trainer's output directory does: with ``save_total_limit`` set, after
each save (and at the end of training) the callback deletes its oldest versions by the Trainer's
own rule (:func:`rotated_out`): the newest and the Trainer's best checkpoint are kept, and at
most ``max(save_total_limit, both)`` remain. Only committed versions whose user data has
:data:`KEY` count; any other version in the store is never touched. An async save counts once
it is committed, so a checkpoint is never deleted for a newer one that may still fail: while it
is in flight the store can hold one version more than the limit.

Nothing is unpickled on either side: ``*.safetensors`` files are read as tensors; files of
``torch.save`` (optimizer, scheduler, RNG states) are read with ``weights_only=True`` (with
the numpy types of the RNG states allowed, as the Trainer does) and stored as tensors and
JSON; other files (JSON, tokenizer files) are stored as their bytes. ``training_args.bin`` is
a pickled ``TrainingArguments``, which ``weights_only`` refuses: it is skipped (the Trainer
does not read it to resume; the arguments come from the resuming script).

What is stored of the directory, and how its names come back (:func:`file_name_problem` is the
one rule, applied on both sides):

- a symbolic link is never followed out of the directory: a link to a file inside it is stored
  as that file, under the link's name; a link to anything else (outside, nowhere, a directory)
  is skipped with a warning naming it, as is anything that is not a regular file;
- file names are stored as they are (dots, spaces, any Unicode), since they are values in the
  manifest, never names in the store; the restore writes them inside a fresh directory, and a
  name that could leave it (``..``, an absolute path, a separator) is refused there. A name
  that cannot be written back the same (not UTF-8, or with ``\\`` or ``:``) is skipped at save
  time with a warning: a name never stops training.
"""

from __future__ import annotations

import logging
import math
import os
import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..errors import CheckpointError, VersionNotFoundError
from ..load.foreign import read_safetensors
from ..store import CheckpointStore
from .hfdir import KEY, file_name_problem, write_checkpoint

log = logging.getLogger(__name__)

_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


class CkptflowCallback(TrainerCallback):
    """Commits every checkpoint the Trainer saves into the store at ``url`` (on world process zero),
    and deletes the versions the Trainer's ``save_total_limit`` rotates out (see the module docstring).

    ``async_save``: the store writes while training goes on; a failed write is raised by the
    next save or at the end of training. ``storage_options``: fsspec options (an S3 endpoint).
    """

    def __init__(
        self, url: str, *, storage_options: dict[str, Any] | None = None, async_save: bool = True
    ) -> None:
        self.store = CheckpointStore(url, storage_options=storage_options)
        self.async_save = async_save

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        saved = read_checkpoint_dir(Path(args.output_dir) / name)
        facts: dict[str, Any] = {
            "epoch": math.floor(state.epoch or 0),
            "step": state.global_step,
            "metrics": _metrics_at(state.log_history, state.global_step),
            "user": {KEY: name},
        }
        if self.async_save:
            self.store.wait()  # the save before is committed (or raises its failure) ...
            self._rotate(args, state)  # ... so it counts; deleting would wait for a save in flight
            self.store.save_async({KEY: saved}, **facts)
        else:
            self.store.save({KEY: saved}, **facts)
            self._rotate(args, state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.store.wait()
        if state.is_world_process_zero:
            self._rotate(args, state)  # the last async save is committed now

    def _rotate(self, args: Any, state: Any) -> None:
        """Delete this callback's committed versions that ``args.save_total_limit`` rotates out."""
        limit = getattr(args, "save_total_limit", None)
        if limit is None or limit <= 0:  # as the Trainer: no rotation
            return
        best = state.best_model_checkpoint  # a local path: output_dir/checkpoint-N
        names = {v.version: v.user[KEY] for v in self.store.versions() if KEY in v.user}
        removed = []
        for version in rotated_out(
            list(names.items()), limit=limit, best=os.path.basename(best) if best else None
        ):
            try:
                self.store.delete(version)
            except CheckpointError as exc:  # a failed delete never stops training; the next save retries
                log.warning("version %d of %s is kept: deleting it failed (%s)", version, self.store.url, exc)
                continue
            removed.append(f"version {version} ({names[version]})")
        if removed:
            log.info("removed %s from %s: save_total_limit=%d", ", ".join(removed), self.store.url, limit)


def rotated_out(saved: list[tuple[int, str]], *, limit: int, best: str | None) -> list[int]:
    """The versions to delete, oldest first, out of ``saved`` ((version, checkpoint name) of the
    callback's committed versions), by the Trainer's rule: the newest and those named ``best`` stay,
    the oldest others go until ``max(limit, those kept)`` remain."""
    ordered = sorted(saved)
    if len(ordered) <= limit:
        return []
    protected = {ordered[-1][0]} | {v for v, name in ordered if best is not None and name == best}
    keep = max(limit, len(protected))
    remaining = len(ordered)
    doomed = []
    for version, _ in ordered:
        if remaining <= keep:
            break
        if version not in protected:
            doomed.append(version)
            remaining -= 1
    return doomed


def restore_trainer_checkpoint(
    url: str,
    output_dir: str | os.PathLike[str],
    *,
    version: int | None = None,
    storage_options: dict[str, Any] | None = None,
    resume_only: bool = False,
) -> str | None:
    """Write ``version`` (default: the newest) as ``output_dir/checkpoint-N``; return its path,
    or None if the store has no version (a new run: said in a warning, since a mistyped URL reads
    the same; ``resume_only`` raises instead). A directory of that name is replaced.

    The Trainer's state names its best checkpoint by path (``load_best_model_at_end``): that
    checkpoint is restored too, beside it, and the path is rewritten to ``output_dir``, so a run
    resumed on another disk or into another directory still ends with its best model."""
    store = CheckpointStore(url, storage_options=storage_options)
    try:
        state = store.load(version)
    except VersionNotFoundError:
        if version is not None:
            raise
        if resume_only:
            raise VersionNotFoundError(None, store.url, []) from None
        log.warning(
            "no checkpoint in %s: starting a new run (check the URL if you meant to resume; "
            "resume_only=True refuses to start one)",
            store.url,
        )
        return None
    if not isinstance(state, dict) or not isinstance(state.get(KEY), dict):
        which = "the newest version" if version is None else f"version {version}"
        raise ValueError(f"{which} of {store.url} is not a Trainer checkpoint (saved by CkptflowCallback)")
    saved = state[KEY]
    best = write_checkpoint(saved, Path(output_dir))
    if best is not None and best != saved["name"]:
        restored = version if version is not None else store.latest()
        upto = restored if isinstance(restored, int) else restored.version if restored else None
        found = [  # the newest of that name saved up to the version restored (not a later run's)
            v.version
            for v in store.versions()
            if v.user.get(KEY) == best and (upto is None or v.version <= upto)
        ]
        if found:
            write_checkpoint(store.load(found[-1])[KEY], Path(output_dir))
        else:
            log.warning(
                "the Trainer's best checkpoint, %s, is not in %s: load_best_model_at_end will not find it",
                best,
                store.url,
            )
    return str(Path(output_dir) / saved["name"])


def read_checkpoint_dir(path: Path, skipped: list[str] | None = None) -> dict[str, Any]:
    """A checkpoint directory as a state a store holds (see the module docstring); ``skipped``
    gets one line for each entry that is not stored (a link out of it, a name that cannot come
    back, what is no regular file), besides the warning logged."""
    files = []
    for rel, f in sorted(_regular_files(path, skipped if skipped is not None else [])):
        suffix = posixpath.splitext(rel)[1]  # the name it comes back as, a link's too
        if suffix == ".safetensors":
            files.append({"path": rel, "kind": "safetensors", "tensors": read_safetensors(f)})
        elif suffix in _TORCH_SUFFIXES:
            try:
                with safe_globals():
                    value = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as exc:
                log.info("%s is skipped: it holds more than tensors (%s)", f, type(exc).__name__)
                continue
            files.append({"path": rel, "kind": "torch", "value": value})
        else:
            files.append(
                {
                    "path": rel,
                    "kind": "bytes",
                    "value": torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8),
                }
            )
    return {"name": path.name, "files": files}


def _regular_files(root: Path, skipped: list[str]) -> Iterator[tuple[str, Path]]:
    """The regular files under ``root``: each one's relative POSIX path and where to read it.

    Symbolic links are not followed out of ``root``; what is not stored is said in a warning,
    and in a line appended to ``skipped``."""

    def skip(line: str) -> None:
        log.warning("%s", line)
        skipped.append(line)

    def unreadable(exc: OSError) -> None:
        skip(f"{exc.filename} is skipped: {exc.strerror}")

    inside = os.path.realpath(root)
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        here = Path(dirpath)
        for name in [d for d in dirnames if (here / d).is_symlink()]:
            dirnames.remove(name)  # os.walk does not enter it either; say so
            link = here / name
            skip(f"{link} is skipped: a symbolic link to a directory ({os.readlink(link)})")
        for name in filenames:
            f = here / name
            rel = f.relative_to(root).as_posix()
            problem = file_name_problem(rel)
            if problem:
                shown = os.fsencode(f).decode("utf-8", "backslashreplace")  # a name that is no UTF-8 too
                skip(f"{shown} is skipped: its name {problem}")
            elif f.is_symlink():
                target = os.path.realpath(f)
                if os.path.commonpath([inside, target]) == inside and os.path.isfile(target):
                    yield rel, Path(target)
                else:
                    where = (
                        "outside the checkpoint directory"
                        if os.path.exists(target)
                        else "which does not exist"
                    )
                    skip(f"{f} is skipped: a symbolic link to {os.readlink(f)}, {where}")
            elif f.is_file():
                yield rel, f
            else:
                skip(f"{f} is skipped: not a regular file")


def _metrics_at(history: list[dict[str, Any]], step: int) -> dict[str, float]:
    """The numbers logged at ``step`` (loss, eval_loss, learning_rate, ...)."""
    found: dict[str, float] = {}
    for record in history:
        if record.get("step") == step:
            found.update(
                {
                    k: float(v)
                    for k, v in record.items()
                    if k not in ("step", "epoch") and isinstance(v, (int, float))
                }
            )
    return found
