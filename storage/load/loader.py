"""Turning the bytes of blobs back into the tensors of a state.

Tensors come back as the manifest describes them: a blob reshaped (tied
weights: one tensor object under every key that shared it), or views of a
blob with their saved strides and offsets (views of one buffer share memory
again). A load may be given *targets*, existing tensors keyed by path (the
model and optimizer a resumed run has just built): a tensor whose path, dtype
and shape match a contiguous target is read straight into the target's memory
(a GPU target's through pinned host memory, see :mod:`.gpu`) and returned as
that very tensor, with no second copy of the state.
"""

from __future__ import annotations

from typing import Any

import torch

from ..format.dtypes import dtype_from_name
from ..format.manifest import Manifest
from ..format.structure import join_path


def tensor_paths(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested dict/list/tuple, by its key path (other values are skipped)."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        found[prefix] = state
    elif isinstance(state, dict):
        for key, value in state.items():
            found.update(tensor_paths(value, join_path(prefix, key)))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            found.update(tensor_paths(value, join_path(prefix, i)))
    return found


def target_buffers(
    manifest: Manifest, leaf_ids: list[int], targets: dict[str, torch.Tensor], device: torch.device
) -> dict[int, torch.Tensor]:
    """Blob -> target tensor, for blobs that can be read straight into an existing tensor (of
    ``targets``, by path): on the CPU when the load is to the CPU, or on a GPU (through pinned
    memory, see :mod:`.gpu`)."""
    strided = {manifest.tensors[i].blob for i in leaf_ids if manifest.tensors[i].stride is not None}
    out: dict[int, torch.Tensor] = {}
    for i in leaf_ids:
        entry = manifest.tensors[i]
        target = targets.get(entry.path)
        if (
            target is None
            or entry.blob in strided
            or entry.blob in out
            or not (target.is_cuda or (target.device.type == "cpu" and device.type == "cpu"))
            or not target.is_contiguous()
            or target.dtype != dtype_from_name(entry.dtype)
            or list(target.shape) != entry.shape
        ):
            continue
        out[entry.blob] = target
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's memory (what the reader fills)."""
    return t.detach().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def build_tensors(
    manifest: Manifest,
    raw: dict[int, torch.Tensor],
    leaf_ids: list[int],
    device: torch.device,
    targets: dict[int, torch.Tensor],
) -> dict[int, torch.Tensor]:
    """Leaf index -> tensor, from the blobs' bytes (``raw``: blob -> uint8 tensor)."""
    typed: dict[tuple[int, str], torch.Tensor] = {}
    whole: dict[int, torch.Tensor] = dict(targets)
    out: dict[int, torch.Tensor] = {}
    for i in leaf_ids:
        entry = manifest.tensors[i]
        dtype = dtype_from_name(entry.dtype)
        tied = whole.get(entry.blob)  # tied weights come back as one tensor, if the very same view
        same = tied is not None and (tied.dtype, list(tied.shape)) == (dtype, entry.shape)
        if entry.stride is None and same and tied is not None:
            out[i] = tied
            continue
        if (entry.blob, entry.dtype) not in typed:
            typed[entry.blob, entry.dtype] = raw[entry.blob].view(dtype).to(device)
        base = typed[entry.blob, entry.dtype]
        if entry.stride is None:
            out[i] = base.reshape(entry.shape)
            whole.setdefault(entry.blob, out[i])
        else:
            out[i] = torch.as_strided(base, entry.shape, entry.stride, entry.offset)
    return out
