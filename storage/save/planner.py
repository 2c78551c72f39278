"""Pure planning: which bytes are stored, and in which shard.

A *blob* is one contiguous run of bytes written to one HDF5 dataset. Usually a
blob is one tensor's own elements. Tensors that share storage (tied weights,
views of one buffer) are stored once: identical views share a blob and come
back as one tensor object; different views of one storage share a blob that
spans the bytes they use, and are rebuilt as views of it, so the sharing
survives the round trip.

Blobs are then spread over N shards by size: largest first into the lightest
shard. Nothing here does I/O; the writer follows the plan.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from ..format.blob import Blob
from ..format.dtypes import storage_dtype
from ..format.structure import Leaf


@dataclass(frozen=True)
class TensorRef:
    """How a leaf is rebuilt from its blob (``stride`` None: the whole blob, reshaped)."""

    blob: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None
    offset: int = 0


@dataclass(frozen=True)
class ChunkPlan:
    """A large tensor stored as row chunks, each its own blob (``rows``: first row, row count and
    blob of each, in order), so that a save that changes part of it writes only the chunks that
    changed (:mod:`.dedup`); it reads back as a chunked tensor of the manifest."""

    leaf: int
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    rows: list[tuple[int, int, int]]


@dataclass(frozen=True)
class ShardPlan:
    index: int
    file: str
    blobs: list[int] = field(default_factory=list)
    nbytes: int = 0


@dataclass(frozen=True)
class SavePlan:
    blobs: list[Blob]
    refs: list[TensorRef]  # one per leaf that is not chunked, in order
    shards: list[ShardPlan]
    chunks: list[ChunkPlan] = field(default_factory=list)  # the leaves stored as row chunks

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blobs)


SHARD_BYTES = 64 << 20  # the default of StoreOptions.shard_bytes
CHUNK_BYTES = 16 << 20  # content-addressed saves cut larger tensors into row chunks of this size


def shard_file_name(rank: int, index: int) -> str:
    return f"shard-r{rank}-{index:02d}.h5"


def plan_save(leaves: list[Leaf], *, shards: int, rank: int = 0, shard_bytes: int = SHARD_BYTES) -> SavePlan:
    """Blobs for ``leaves`` and their split into at most ``shards`` files."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    blobs, refs = plan_blobs(leaves)
    return SavePlan(blobs, refs, assign_shards(blobs, shards=shards, rank=rank, shard_bytes=shard_bytes))


def plan_blobs(leaves: list[Leaf], chunk_bytes: int | None = None) -> tuple[list[Blob], list[TensorRef]]:
    """Group leaves by the storage they live in; one blob per group (or per view)."""
    blobs, refs, _ = plan_chunked_blobs(leaves, chunk_bytes)
    return blobs, refs


def plan_chunked_blobs(
    leaves: list[Leaf], chunk_bytes: int | None
) -> tuple[list[Blob], list[TensorRef], list[ChunkPlan]]:
    """:func:`plan_blobs`, with every contiguous tensor of its own storage larger than
    ``chunk_bytes`` (None: none) cut into row chunks of at most that size, a blob each."""
    groups: dict[object, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(_storage_key(leaf.tensor, i), []).append(i)
    blobs: list[Blob] = []
    refs: list[TensorRef | None] = [None] * len(leaves)
    chunks: list[ChunkPlan] = []
    names: set[str] = set()
    for members in groups.values():
        if len(members) == 1:  # most tensors: a storage of their own
            leaf = leaves[members[0]]
            t = leaf.tensor
            shape = tuple(t.shape)
            if chunk_bytes is not None and _chunked(leaf, chunk_bytes):
                chunks.append(_plan_chunks(members[0], leaf, chunk_bytes, blobs, names))
                continue
            blob = _new_blob(blobs, names, leaf.path, t.dtype, shape, t)
            refs[members[0]] = TensorRef(blob, t.dtype, shape)
        else:
            _plan_group(leaves, members, blobs, refs, names)
    return blobs, [r for r in refs if r is not None], chunks


def _chunked(leaf: Leaf, chunk_bytes: int) -> bool:
    t = leaf.tensor
    return (
        not leaf.is_numpy
        and t.dim() >= 1
        and t.shape[0] > 1
        and t.is_contiguous()
        and t.numel() * t.element_size() > chunk_bytes
    )


def _plan_chunks(index: int, leaf: Leaf, chunk_bytes: int, blobs: list[Blob], names: set[str]) -> ChunkPlan:
    t = leaf.tensor
    row_bytes = max(1, t[0].numel() * t.element_size())
    step = max(1, chunk_bytes // row_bytes)
    rows = []
    for first in range(0, t.shape[0], step):
        part = t[first : first + step]
        blob = _new_blob(blobs, names, f"{leaf.path}@{first}", t.dtype, tuple(part.shape), part)
        rows.append((first, part.shape[0], blob))
    return ChunkPlan(index, leaf.path, t.dtype, tuple(t.shape), rows)


def _storage_key(t: torch.Tensor, i: int) -> object:
    if t.numel() == 0:
        return ("empty", i)
    return (t.device, t.untyped_storage().data_ptr())


def _view_key(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


def _plan_group(
    leaves: list[Leaf], members: list[int], blobs: list[Blob], refs: list[TensorRef | None], names: set[str]
) -> None:
    views: dict[tuple, list[int]] = {}
    for i in members:
        views.setdefault(_view_key(leaves[i].tensor), []).append(i)
    dtypes = {key[0] for key in views}
    if len(views) == 1 or len(dtypes) > 1:
        # One view (tied weights: the same tensor under several keys), or views of
        # different dtypes over one storage, which are stored apart.
        for same in views.values():
            t = leaves[same[0]].tensor
            blob = _new_blob(blobs, names, leaves[same[0]].path, t.dtype, tuple(t.shape), t)
            for i in same:
                refs[i] = TensorRef(blob, t.dtype, tuple(t.shape))
        return
    first = leaves[members[0]].tensor
    start = min(int(leaves[i].tensor.storage_offset()) for i in members)
    end = max(_extent_end(leaves[i].tensor) for i in members)
    span = torch.as_strided(first, (end - start,), (1,), start)
    blob = _new_blob(blobs, names, leaves[members[0]].path, first.dtype, (end - start,), span)
    for i in members:
        t = leaves[i].tensor
        refs[i] = TensorRef(blob, t.dtype, tuple(t.shape), t.stride(), int(t.storage_offset()) - start)


def _extent_end(t: torch.Tensor) -> int:
    return int(t.storage_offset()) + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1


def _new_blob(
    blobs: list[Blob],
    names: set[str],
    path: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    source: torch.Tensor,
) -> int:
    storage_dtype(dtype)  # raises early for dtypes we cannot store
    blobs.append(Blob(len(blobs), dataset_name(path, names), dtype, shape, source))
    return len(blobs) - 1


def dataset_name(path: str, taken: set[str]) -> str:
    """A unique, flat HDF5 dataset name for a key path (``model/fc.weight`` -> ``model.fc.weight``).

    HDF5 names are NUL-terminated: a NUL in a key is escaped.
    """
    base = path.replace("/", ".").replace("\x00", "\\x00") or "root"
    if base in (".", ".."):
        base = f"_{base}"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}#{n}"
    taken.add(name)
    return name


def shards_per_rank(shards: int, world_size: int) -> list[int]:
    """How many of a version's shard files each rank writes: ``shards`` in all at every world
    size (the first ``shards % world_size`` ranks one more), but at least one per rank, so that
    every rank writes its share: a job of more ranks than ``shards`` writes one file per rank."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    base, extra = divmod(max(shards, world_size), world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def assign_rank_shards(
    blobs: list[Blob], *, shards: int, world_size: int, rank: int, shard_bytes: int = SHARD_BYTES
) -> list[ShardPlan]:
    """This rank's files of blobs every rank holds alike (a replicated state): the blobs are
    balanced by bytes over the ranks, and each rank's share into its number of files
    (:func:`shards_per_rank`). Every rank computes the same split on its own."""
    share = balance(blobs, world_size)[rank]
    if not share:
        return []
    return assign_shards(
        share, shards=shards_per_rank(shards, world_size)[rank], rank=rank, shard_bytes=shard_bytes
    )


def shard_count(nbytes: int, shards: int, shard_bytes: int = SHARD_BYTES) -> int:
    """How many files ``nbytes`` of state are written as: at most ``shards``, and one per
    ``shard_bytes`` (a small state is one file, as cheap to write as one ``torch.save``)."""
    return max(1, min(shards, -(-nbytes // shard_bytes)))


def assign_shards(
    blobs: list[Blob], *, shards: int, rank: int = 0, shard_bytes: int = SHARD_BYTES
) -> list[ShardPlan]:
    """Largest blob first into the lightest of :func:`shard_count` shards; empty ones are dropped."""
    plans: list[ShardPlan] = []
    for members in balance(blobs, shard_count(sum(b.nbytes for b in blobs), shards, shard_bytes)):
        if members:
            load = sum(b.nbytes for b in members)
            indices = sorted(b.index for b in members)
            plans.append(ShardPlan(len(plans), shard_file_name(rank, len(plans)), indices, load))
    if not plans:  # a state without tensors still gets one (small) shard file
        plans.append(ShardPlan(0, shard_file_name(rank, 0)))
    return plans


def balance(blobs: list[Blob], bins: int) -> list[list[Blob]]:
    """Split blobs into ``bins`` groups of about equal bytes: largest first into the lightest group.

    Deterministic: the same blobs, in any order, give the same groups (every rank of a
    multi-process save computes the same split of the replicated state on its own).
    """
    if bins == 1:
        return [list(blobs)]
    groups: list[list[Blob]] = [[] for _ in range(bins)]
    lightest = [(0, s) for s in range(bins)]  # (load, group): a heap, ties to the lower group
    for blob in sorted(blobs, key=lambda b: (-b.nbytes, b.index)):
        load, target = heapq.heappop(lightest)
        groups[target].append(blob)
        heapq.heappush(lightest, (load + blob.nbytes, target))
    return groups
