"""Restoring a state: a located version's manifest turned back into the state that was saved.

Selects the key paths asked for, reads only their blobs (into the caller's tensors where
they match), and rebuilds the structure around the tensors. Per-rank state is mapped by
one documented rule when the number of ranks changed.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..files.location import Location, translate_errors
from ..format.manifest import Manifest
from ..info import StoreOptions
from .reader import read_blobs

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

    from ..versions.catalog import Located


class RankStateWarning(UserWarning):
    """Per-rank state saved by a different number of ranks was mapped by the documented rule."""


def rank_manifest(manifest: Manifest, rank: int, world: int, *, stacklevel: int) -> Manifest | None:
    """The view of ``manifest`` holding rank ``rank``'s state in a job of ``world`` ranks, or None if
    none was saved: rank r's when saved by ``world`` ranks, else rank 0's (with a warning)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    if not manifest.ranks:
        return None
    source = rank
    if len(manifest.ranks) != world:
        source = 0
        warnings.warn(
            RankStateWarning(
                f"version {manifest.version} was saved by {len(manifest.ranks)} rank(s), this job has "
                f"{world}: rank {rank} gets the per-rank state of rank 0"
            ),
            stacklevel=stacklevel + 1,
        )
    return manifest.rank_view(source)


def read_state(
    loc: Location,
    options: StoreOptions,
    located: Located,
    manifest: Manifest,
    keys: Sequence[str] | None,
    map_location: str | torch.device,
    verify: bool | None,
    into: Any,
) -> Any:
    """The state ``manifest`` (of the version ``located``) describes, or the parts under ``keys``.

    Chunked tensors (a sharded save) come back whole: their chunks put together.
    """
    import torch

    from ..format.structure import decode, leaf_refs, select
    from . import gpu
    from .loader import as_bytes, build_tensors, target_buffers, tensor_paths

    structure = select(manifest.structure, list(keys)) if keys else manifest.structure
    leaf_ids = sorted(set(leaf_refs(structure)))
    chunked_ids = sorted(set(leaf_refs(structure, ("$chunked",))))
    chunks = {c.blob for i in chunked_ids for c in manifest.chunked[i].chunks}
    wanted = sorted({manifest.tensors[i].blob for i in leaf_ids} | chunks)
    check = options.verify_on_load if verify is None else verify
    device = torch.device(map_location)
    given = tensor_paths(into) if into is not None else {}
    if given and not keys:
        _warn_unfilled(given, manifest, leaf_ids, chunked_ids)
    targets = target_buffers(manifest, leaf_ids, given, device)
    onto = {b: as_bytes(t) for b, t in targets.items() if t.is_cuda}  # through pinned memory
    # chunks are put together on the host and moved whole: on the GPU they would take it twice
    to_gpu = set(wanted) - chunks if device.type == "cuda" else set(onto)
    gpu_device = device if device.type == "cuda" else next((t.device for t in onto.values()), device)

    def read(blobs: list[int], buffers: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return read_blobs(
            loc, located.sources(loc), manifest, blobs, verify=check, threads=options.threads, buffers=buffers
        )

    # Row chunks of a tensor (a large tensor of a content-addressed save) are read straight into
    # their rows of the tensor they make up, when that is on the host: no copy after the read.
    on_host = given if device.type == "cpu" else {}  # the caller's tensors are filled on the host only
    placed = {i: out for i in chunked_ids if (out := _row_chunked(manifest, i, on_host)) is not None}
    into_rows = {
        c.blob: as_bytes(out.narrow(0, c.offsets[0], c.sizes[0]))
        for i, out in placed.items()
        for c in manifest.chunked[i].chunks
    }
    with translate_errors(loc, "loading from"):
        if check:
            located.check_tarball(loc, whole=False)
        raw = read(
            [b for b in wanted if b not in to_gpu],
            {**into_rows, **{blob: as_bytes(t) for blob, t in targets.items() if not t.is_cuda}},
        )
        if to_gpu:
            sizes = {b: manifest.blobs[b].nbytes for b in sorted(to_gpu)}
            raw.update(gpu.read_onto(gpu_device, sizes, read, onto))
    tensors = build_tensors(manifest, raw, leaf_ids, device, targets)
    whole = {
        i: (placed[i] if i in placed else _assemble(manifest, i, raw, on_host)).to(device)
        for i in chunked_ids
    }
    if given:  # the caller's tensors on an accelerator: filled from the copies read above
        _copied_into(given, {manifest.tensors[i].path: (tensors, i) for i in leaf_ids})
        _copied_into(given, {manifest.chunked[i].path: (whole, i) for i in chunked_ids})
    return decode(
        structure, lambda i, is_numpy: tensors[i].cpu().numpy() if is_numpy else tensors[i], whole.__getitem__
    )


def _warn_unfilled(
    given: dict[str, Any], manifest: Manifest, leaf_ids: list[int], chunked_ids: list[int]
) -> None:
    """Say which tensors of ``into`` the version does not hold (they are left as they are, and the
    state returned has the version's keys), and why when it is an optimizer's layout."""
    stored = {manifest.tensors[i].path for i in leaf_ids} | {manifest.chunked[i].path for i in chunked_ids}
    missing = sorted(p for p in given if p not in stored)
    if not missing:
        return
    hint = ""
    if any(_by_name(p) for p in missing) and any(_by_number(p) for p in stored):
        hint = (
            "; the version keeps an optimizer's state by parameter number, as opt.state_dict() gives "
            "it, and the state to fill by name, as get_state_dict gives it: pass what load() returns "
            "to opt.load_state_dict(...) or to torch's set_state_dict(model, opt, ...), which take "
            "either layout"
        )
    log.warning(
        "version %d holds no tensor at %d key path(s) of the state to fill (%s%s): those are left as "
        "they are, and the state returned has the version's keys%s",
        manifest.version,
        len(missing),
        ", ".join(missing[:3]),
        ", ..." if len(missing) > 3 else "",
        hint,
    )


def _by_name(path: str) -> bool:
    parts = path.split("/")
    return any(a == "state" and not b.isdigit() for a, b in itertools.pairwise(parts))


def _by_number(path: str) -> bool:
    parts = path.split("/")
    return any(a == "state" and b.isdigit() for a, b in itertools.pairwise(parts))


def _copied_into(given: dict[str, torch.Tensor], read: dict[str, tuple[dict[int, Any], int]]) -> None:
    """Each tensor read whose path holds a GPU tensor of ``given``, of its dtype and shape (one not
    read into already: non-contiguous, say), copied into that tensor, which takes its place: a load
    into a GPU model's state fills it in place, as a load into CPU tensors reads into them."""
    for path, (tensors, i) in read.items():
        target = given.get(path)
        tensor = tensors[i]
        if (
            target is not None
            and target is not tensor
            and target.is_cuda
            and (target.dtype, target.shape) == (tensor.dtype, tensor.shape)
        ):
            target.detach().copy_(tensor)  # a parameter that requires grad, too
            tensors[i] = target


def _row_chunked(manifest: Manifest, index: int, given: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The host tensor chunked tensor ``index`` is read into when its chunks are whole rows, in
    order (the caller's plain CPU tensor at its path when it fits, else a new one); None for
    other chunks (a DTensor's), which are read apart and put together."""
    import torch

    from ..format.dtypes import dtype_from_name

    entry = manifest.chunked[index]
    if not entry.shape:
        return None
    rest = entry.shape[1:]
    at = 0
    for chunk in entry.chunks:
        if chunk.offsets[0] != at or any(chunk.offsets[1:]) or chunk.sizes[1:] != rest:
            return None
        at += chunk.sizes[0]
    if at != entry.shape[0]:
        return None
    dtype = dtype_from_name(entry.dtype)
    out = given.get(entry.path)
    fits = type(out) is torch.Tensor and out.device.type == "cpu" and out.dtype == dtype
    fits = fits and out is not None and out.is_contiguous()
    if out is None or not fits or list(out.shape) != entry.shape:
        out = torch.empty(entry.shape, dtype=dtype)
    return out


def _assemble(
    manifest: Manifest, index: int, raw: dict[int, torch.Tensor], given: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Chunked tensor ``index`` whole, from its chunks' bytes (into the caller's tensor at its path
    when that is a plain CPU tensor of its dtype and shape)."""
    import torch

    from ..format.dtypes import dtype_from_name

    entry = manifest.chunked[index]
    dtype = dtype_from_name(entry.dtype)
    out = given.get(entry.path)
    fits = type(out) is torch.Tensor and out.device.type == "cpu" and out.dtype == dtype
    if out is None or not fits or list(out.shape) != entry.shape:
        out = torch.empty(entry.shape, dtype=dtype)
    for chunk in entry.chunks:
        part = out
        for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
            part = part.narrow(dim, start, length)
        part.copy_(raw[chunk.blob].view(dtype).reshape(chunk.sizes))
    return out
