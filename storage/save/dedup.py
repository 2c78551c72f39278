"""Content-addressed saves: reference the bytes a committed version holds instead of writing them.

Before a save writes, it computes every blob's content key (the xxh3-128 of its bytes, which is
also the blob's checksum in the manifest: :func:`.checksum.content_key`) and looks it up, with
the blob's dtype and size, in a :class:`ContentIndex`: the blobs of the version the store last
committed or loaded (its lineage's parent), which lists every blob that version holds or
references. A blob found there is not written: this version's manifest lists the file that holds
it (a shard of another version's directory, ``ShardEntry.version``) and its place in that file.
Only the other blobs are planned into this version's own shard files.

A frozen base saved at every step is written once; a dense state where everything changes is
written whole, at the cost of one hash per byte, which replaces the blob hash the writer computed
while writing (:mod:`.writer`). A shard file is referenced only when it supplies at least
``1/MIN_SHARE`` of its bytes to the new version, so that a version never keeps a large file of
an old version alive for a few small tensors of it (those are written again instead).

Bytes are referenced only within one store (a manifest's shards name versions of its own
store), and only files of loose versions; removal (:mod:`..versions.housekeeping`) never
removes a file a committed version references.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..format.checksum import content_key
from ..format.dtypes import dtype_name
from ..format.manifest import BlobEntry, ShardEntry
from .planner import Blob, SavePlan, assign_shards

BlobBytes = Callable[[Blob], memoryview]
MIN_SHARE = 4  # a referenced shard file supplies at least 1/MIN_SHARE of its bytes
PARALLEL_BYTES = 64 << 20  # states larger than this are hashed by several threads

Key = tuple[str, str, int]  # (xxh3-128 of the bytes, dtype name, bytes)


@dataclass(frozen=True)
class Held:
    """Where a committed blob's bytes are: a shard (by its number in the index) and the entry."""

    shard: int
    dataset: str
    offset: int


class ContentIndex:
    """The blobs one committed version holds or references, by content key, dtype and size."""

    def __init__(
        self, version: int, shards: list[ShardEntry], blobs: Iterable[dict[str, Any] | BlobEntry]
    ) -> None:
        self.version = version
        # Every shard in the form a later version's manifest lists it: with the version it is in.
        self.shards = [
            s if s.version is not None else s.model_copy(update={"version": version}) for s in shards
        ]
        self.held: dict[Key, Held] = {}
        for blob in blobs:
            b = blob if isinstance(blob, dict) else blob.model_dump()
            checksum = b["checksum"]
            if len(checksum) != 32 or not b["nbytes"] or b["offset"] is None or b.get("pieces"):
                continue  # not content-addressed (an older format), empty, or a chunk with pieces
            self.held[(checksum, b["dtype"], b["nbytes"])] = Held(b["shard"], b["dataset"], b["offset"])


@dataclass(frozen=True)
class Split:
    """A rank's share of a save, split by the index: the blobs it writes, in their own plan, and
    the entries of those it references."""

    plan: SavePlan  # the blobs to write, planned into this version's shard files
    keys: dict[int, str]  # every blob's content key (its checksum in the manifest)
    reused: dict[int, tuple[ShardEntry, Held]]  # blob index -> the file and place of its bytes

    @property
    def reused_bytes(self) -> int:
        return sum(self.plan.blobs[i].nbytes for i in self.reused)

    def merge(
        self, shards: list[ShardEntry], entries: dict[int, dict[str, Any]]
    ) -> tuple[list[ShardEntry], dict[int, dict[str, Any]]]:
        """The written shards and blob entries, with the referenced files appended to the shards
        and the referenced blobs' entries pointing at them."""
        from ..format.manifest import blob_doc

        shards = list(shards)
        number: dict[tuple[int | None, str], int] = {}
        entries = dict(entries)
        for index, (shard, held) in self.reused.items():
            place = (shard.version, shard.file)
            if place not in number:
                number[place] = len(shards)
                shards.append(shard)
            blob = self.plan.blobs[index]
            entries[index] = blob_doc(
                shard=number[place],
                dataset=held.dataset,
                offset=held.offset,
                nbytes=blob.nbytes,
                dtype=dtype_name(blob.dtype),
                shape=list(blob.shape),
                checksum=self.keys[index],
            )
        return shards, entries


def split(
    plan: SavePlan,
    blob_bytes: BlobBytes,
    index: ContentIndex | None,
    *,
    rank: int,
    shard_bytes: int,
    threads: int,
) -> Split:
    """Hash this rank's blobs of ``plan`` and split them into those ``index`` holds and those to
    write, planned into as many files as ``plan`` had (none when every blob is referenced)."""
    mine = [plan.blobs[i] for shard in plan.shards for i in shard.blobs]
    keys = _keys(mine, blob_bytes, threads)
    reused: dict[int, tuple[ShardEntry, Held]] = {}
    if index is not None and index.held:
        found: dict[int, Held] = {}
        for blob in mine:
            if blob.nbytes:
                held = index.held.get((keys[blob.index], dtype_name(blob.dtype), blob.nbytes))
                if held is not None:
                    found[blob.index] = held
        supplied: dict[int, int] = {}
        for i, held in found.items():
            supplied[held.shard] = supplied.get(held.shard, 0) + plan.blobs[i].nbytes
        worth = {s for s, n in supplied.items() if n * MIN_SHARE >= index.shards[s].size}
        reused = {i: (index.shards[h.shard], h) for i, h in found.items() if h.shard in worth}
    if not reused:
        return Split(plan, keys, {})
    new = [b for b in mine if b.index not in reused]
    files = assign_shards(new, shards=len(plan.shards), rank=rank, shard_bytes=shard_bytes) if new else []
    return Split(SavePlan(plan.blobs, plan.refs, files), keys, reused)


def _keys(blobs: list[Blob], blob_bytes: BlobBytes, threads: int) -> dict[int, str]:
    """Every blob's content key; a large state is hashed by ``threads`` threads (xxh3 releases
    the GIL), largest blobs first."""

    def one(blob: Blob) -> tuple[int, str]:
        return blob.index, content_key(blob_bytes(blob))

    if threads > 1 and sum(b.nbytes for b in blobs) > PARALLEL_BYTES:
        ordered = sorted(blobs, key=lambda b: -b.nbytes)
        with ThreadPoolExecutor(threads, thread_name_prefix="ckptflow-hash") as pool:
            return dict(pool.map(one, ordered))
    return dict(one(b) for b in blobs)
