"""Write a loaded checkpoint state to one portable file: torch or safetensors.

This is what ``ckptflow restore`` hands to people and tools outside ckptflow.

What always holds: the target path holds either its previous content or the
complete new file, never half of one. The file is written under a temporary
name beside the target, fsynced, renamed into place, and the directory is
fsynced; a failure removes the temporary file. The file gets the mode a plain
``open(path, "w")`` would give it (0666 less the umask; an overwritten file
keeps its own), whichever library wrote it. Nothing is written through a
symbolic link at the target: the rename replaces the link itself, and what it
points to is left as it was (``ckptflow restore`` refuses such a target first).

- torch: the nested state as saved (dicts, lists, tuples, tensors, numbers,
  strings, bytes, dtypes), numpy arrays turned into tensors, so that
  ``torch.load(path, weights_only=True)`` opens it. Tensors that shared memory
  when loaded (tied weights) still share it.
- safetensors: only the tensors, as one flat dict keyed by slash-joined key
  path (``model/fc.weight``, ``optimizer/state/0/exp_avg``); everything else is
  left out. safetensors refuses tensors that share memory, so those are cloned.
- Hugging Face's sharded layout (:func:`write_hf_shards`): the same flat
  tensors in a directory, ``model-0000k-of-0000n.safetensors`` files of at most
  a given size and ``model.safetensors.index.json`` (one ``model.safetensors``
  if they fit in one), written by ``huggingface_hub.save_torch_state_dict``;
  the directory appears whole or not at all.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ckptflow.storage import CheckpointError

Format = Literal["torch", "safetensors"]


def write_state(state: Any, out: Path, *, fmt: Format, metadata: dict[str, str] | None = None) -> int:
    """Write ``state`` to ``out`` atomically; return how many tensors the file holds."""
    if fmt == "torch":
        portable = as_torch(state)
        write_atomic(out, lambda tmp: torch.save(portable, tmp))
        return sum(1 for _ in iter_tensors(portable))
    tensors = unshared(flat_tensors(state))
    write_atomic(out, lambda tmp: _save_safetensors(tensors, tmp, metadata or {}))
    return len(tensors)


def write_hf_shards(
    state: Any, out: Path, *, max_shard_size: str, metadata: dict[str, str] | None = None
) -> tuple[int, list[str]]:
    """Write ``state``'s tensors to the directory ``out`` in Hugging Face's sharded safetensors
    layout; return how many tensors and the files written. An existing ``out`` is replaced whole."""
    try:
        from huggingface_hub import save_torch_state_dict
    except ImportError:
        raise CheckpointError(
            "the sharded layout needs huggingface_hub: pip install 'ckptflow[hf-export]'"
        ) from None
    tensors = unshared(flat_tensors(state))
    target = _unfollowed(out)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    old = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.old")
    tmp.mkdir()
    try:
        save_torch_state_dict(tensors, tmp, max_shard_size=max_shard_size, metadata=metadata or {})
        files = sorted(p.name for p in tmp.iterdir())
        for name in files:
            _fsync(tmp / name)
        _fsync(tmp)
        if os.path.lexists(target):
            os.rename(target, old)  # the old directory (or link) goes only once the new one is complete
        os.rename(tmp, target)
        _fsync(target.parent)
    except CheckpointError:
        raise
    except Exception as exc:  # huggingface_hub's and safetensors' own errors
        raise CheckpointError(f"writing {out} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.is_symlink():
            old.unlink()  # the link only, never what it points to
        shutil.rmtree(old, ignore_errors=True)
    return len(tensors), files


def selected_subtree(state: Any, path: str) -> Any:
    """What ``load(keys=[path])`` nests under ``path``: the one child of each dict along it (keys
    as the state has them, ints included); None if the state is not nested that way."""
    node = state
    for _ in path.strip("/").split("/"):
        if not (isinstance(node, dict) and len(node) == 1):
            return None
        node = next(iter(node.values()))
    return node


def write_atomic(out: Path, write: Callable[[Path], object]) -> None:
    """Run ``write(tmp)`` on a temporary path beside ``out``, then make it ``out`` durably."""
    target = _unfollowed(out)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, _mode_for(target))
        _fsync(tmp)
        os.replace(tmp, target)
    except (CheckpointError, OSError):
        raise
    except Exception as exc:  # the writers' own errors: torch's RuntimeError, SafetensorError
        raise CheckpointError(f"writing {out} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    _fsync(target.parent)  # the rename


def _unfollowed(out: Path) -> Path:
    """``out`` made absolute, its directory resolved but not its own name: a link there is
    replaced, never written through."""
    return out.absolute().parent.resolve() / out.name


def _fsync(path: Path) -> None:
    """Make a file's bytes, or a directory's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mode_for(target: Path) -> int:
    """The mode ``open(target, "w")`` would leave: an existing file's own, else (nothing there, or a
    link the write replaces) 0666 less the umask.

    The writers differ (safetensors creates its file 0600, torch.save 0666 less the umask).
    """
    try:
        found = os.lstat(target)
    except FileNotFoundError:
        found = None
    if found is not None and stat.S_ISREG(found.st_mode):
        return stat.S_IMODE(found.st_mode)
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def as_torch(node: Any) -> Any:
    """``node`` with numpy arrays turned into tensors; everything else kept as loaded."""
    if isinstance(node, np.ndarray):
        return torch.from_numpy(node)
    if isinstance(node, dict):
        return {k: as_torch(v) for k, v in node.items()}
    if isinstance(node, list):
        return [as_torch(v) for v in node]
    if isinstance(node, tuple):
        return tuple(as_torch(v) for v in node)
    return node


def iter_tensors(node: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor (numpy arrays as tensors) below ``node``, with its slash-joined key path."""
    if isinstance(node, np.ndarray):
        node = torch.from_numpy(node)
    if isinstance(node, torch.Tensor):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from iter_tensors(value, f"{path}/{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from iter_tensors(value, f"{path}/{index}" if path else str(index))


def flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` as one flat dict by key path; raise if two paths collide."""
    flat: dict[str, torch.Tensor] = {}
    for path, tensor in iter_tensors(state):
        key = path or "tensor"
        if key in flat:
            raise CheckpointError(f"two tensors have the key path {key!r}; use --format torch")
        flat[key] = tensor
    return flat


def unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, each with memory of its own (the first user of a storage keeps it)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        try:
            tensor = tensor.contiguous()
            pointer = tensor.untyped_storage().data_ptr()
            if pointer and pointer in seen:
                tensor = tensor.clone()
        except (RuntimeError, MemoryError) as exc:  # a view far larger than its stored bytes
            raise CheckpointError(
                f"tensor {key} (shape {list(tensor.shape)}, {tensor.dtype}) cannot be written out "
                f"whole: {str(exc).splitlines()[0]}"
            ) from None
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"the safetensors format cannot hold this state ({type(exc).__name__}: {exc}); use --format torch"
        ) from None
