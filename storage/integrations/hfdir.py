"""A Hugging Face Trainer checkpoint directory as a store holds it, written back: the files of
``checkpoint-N/`` (safetensors as tensors, torch files as tensors and JSON, the rest as bytes; see
:mod:`.hf`, which reads them). Nothing here imports transformers: the CLI's export of a Trainer
checkpoint as a ``from_pretrained`` directory (:func:`export_pretrained`) needs only torch and
safetensors.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..format.names import is_plain_name

log = logging.getLogger(__name__)

KEY = "hf_checkpoint"  # a Trainer checkpoint's state in a version: {"name": "checkpoint-N", "files": [...]}
CHECKPOINT_PREFIX = "checkpoint-"  # the Trainer's PREFIX_CHECKPOINT_DIR, and a dash
# The Trainer's own files of a checkpoint: its state to resume, no part of the model.
TRAINING_FILES = re.compile(
    r"(optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth|trainer_state\.json|training_args\.bin)"
)


def export_pretrained(state: Any, out: Path) -> list[str]:
    """Write the model files of a Trainer checkpoint (``state``: a version the Hugging Face callback
    saved) into the new directory ``out``, which ``from_pretrained`` (and a tokenizer's) then loads:
    its config, weights, generation config and tokenizer files, without the Trainer's own state
    (optimizer, scheduler, RNG states). The directory appears whole or not at all; the names of
    the files written, sorted."""
    saved = state.get(KEY) if isinstance(state, dict) else None
    if not isinstance(saved, dict) or not isinstance(saved.get("files"), list):
        raise CheckpointError(
            "not a Hugging Face Trainer checkpoint (saved by CkptflowCallback): --format hf writes a "
            "from_pretrained directory from one; for other states use --format safetensors "
            "--max-shard-size (tensors only, without a config.json)"
        )
    files = [e for e in saved["files"] if not TRAINING_FILES.fullmatch(str(e.get("path")))]
    names = sorted(str(e["path"]) for e in files)
    if "config.json" not in names:
        raise CheckpointError(
            f"{saved.get('name')} holds no config.json, which from_pretrained needs: the Trainer saved "
            "no model configuration with it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for entry in files:
            write_file(staging, entry)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return names


def write_checkpoint(saved: dict[str, Any], output_dir: Path) -> str | None:
    """Write a stored checkpoint directory into ``output_dir``, whole or not at all, with its
    Trainer state's best checkpoint moved into ``output_dir``; the best one's name, if any."""
    check_name(saved["name"])
    target = output_dir / saved["name"]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{saved['name']}.", dir=target.parent))
    try:
        for entry in saved["files"]:
            write_file(staging, entry)
        best = _move_best(staging / TRAINER_STATE, output_dir)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return best


TRAINER_STATE = "trainer_state.json"  # the Trainer's state; best_model_checkpoint is a path


def _move_best(state_file: Path, output_dir: Path) -> str | None:
    """Point the Trainer state's ``best_model_checkpoint`` into ``output_dir`` (it names the
    directory the run saved to); return the best checkpoint's name, or None."""
    if not state_file.is_file():
        return None
    state = json.loads(state_file.read_text())
    best = state.get("best_model_checkpoint") if isinstance(state, dict) else None
    if not isinstance(best, str) or not best:
        return None
    name = posixpath.basename(best.replace("\\", "/").rstrip("/"))
    if file_name_problem(name) is not None or not name.startswith(f"{CHECKPOINT_PREFIX}"):
        log.warning("the Trainer state's best checkpoint %r is no checkpoint directory: left as it is", best)
        return None
    moved = str(output_dir / name)
    if moved != best:
        state["best_model_checkpoint"] = moved
        state_file.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    return name


def file_name_problem(path: Any) -> str | None:
    """Why the relative path ``path`` cannot be stored, or written back the same inside the
    checkpoint directory (None: it can). Any Unicode name is fine, dots and spaces included."""
    if not isinstance(path, str) or not path:
        return "is empty"
    if path.startswith("/"):
        return "is an absolute path"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "has an empty, '.' or '..' component"
    bad = sorted({c for c in path if c in "\\:\0"})
    if bad:
        return f"has {' and '.join(map(repr, bad))}, a path separator or drive on some systems"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    return None


def check_name(name: Any) -> None:
    """A crafted manifest must not make the restore write outside the output directory."""
    if not is_plain_name(name):
        raise ValueError(f"refusing to restore a checkpoint named {name!r}: not a plain directory name")


def check_path(path: Any) -> str:
    """``path`` if it is a relative path that stays inside the checkpoint directory."""
    problem = file_name_problem(path)
    if problem:
        raise ValueError(f"refusing to write {path!r} outside the checkpoint directory: it {problem}")
    return str(path)


def write_file(root: Path, entry: dict[str, Any]) -> None:
    out = root / check_path(entry["path"])
    out.parent.mkdir(parents=True, exist_ok=True)
    if entry["kind"] == "safetensors":
        save_file(entry["tensors"], out, metadata={"format": "pt"})
    elif entry["kind"] == "torch":
        torch.save(entry["value"], out)
    elif entry["kind"] == "bytes":
        out.write_bytes(entry["value"].numpy().tobytes())
    else:
        raise ValueError(f"unknown file kind {entry['kind']!r} for {entry['path']}")
