"""Verify a version: every byte against every checksum its manifest holds.

A manifest has two levels of checksums: each shard file's, and each blob's
(the bytes of one tensor inside its shard, what ``load`` checks), and the
chunks of sharded saves have a third: one per piece of the blob, what a
resharded load checks. ``verify`` checks them all, so a version that verifies
also loads. Each shard is read once, front to back: the chunk that feeds the
shard's hasher also feeds the hashers of the blobs and pieces it overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CorruptShardError
from ..files.byteio import read_chunks
from ..files.location import Location
from ..files.sources import ShardSource
from ..format.checksum import blob_hasher, new_hasher
from ..format.manifest import BlobEntry, Manifest
from .reader import check_size


def verify_version(loc: Location, manifest: Manifest, sources: list[ShardSource]) -> None:
    """Raise :class:`CorruptShardError` naming the first shard whose bytes do not match (with the
    file's checksums: ``xxhsum -H3`` can confirm them), or the narrowest range that does not: a
    piece, else a blob."""
    blobs = [*manifest.blobs, *(b for part in manifest.ranks for b in part.blobs)]
    for index, (shard, source) in enumerate(zip(manifest.shards, sources, strict=True)):
        check_size(loc, source)
        inside = [b for b in blobs if b.shard == index and b.offset is not None and b.nbytes]
        ranges = sorted((r for blob in inside for r in _ranges(blob)), key=lambda r: r.start)
        whole, parts = _digests(loc, source, shard.size, ranges)
        if whole != shard.checksum:
            raise CorruptShardError(source.name, expected=shard.checksum, actual=whole)
        found = zip(ranges, parts, strict=True)
        for r, actual in sorted(found, key=lambda pair: not pair[0].piece):  # the narrowest first
            if actual != r.expected:
                raise CorruptShardError(f"{source.name} ({r.what})", expected=r.expected, actual=actual)


@dataclass(frozen=True)
class _Range:
    """Bytes of a shard with a checksum of their own: a blob, or a piece of one."""

    start: int
    nbytes: int
    expected: str
    what: str
    piece: bool = False


def _ranges(blob: BlobEntry) -> list[_Range]:
    start = blob.offset or 0
    found = [_Range(start, blob.nbytes, blob.checksum, f"dataset {blob.dataset}")]
    if blob.piece_bytes is not None and blob.pieces is not None:
        size = blob.piece_bytes
        found += [
            _Range(
                start + k * size,
                min(size, blob.nbytes - k * size),
                checksum,
                f"dataset {blob.dataset}, piece {k}",
                piece=True,
            )
            for k, checksum in enumerate(blob.pieces)
        ]
    return found


def _digests(loc: Location, source: ShardSource, size: int, ranges: list[_Range]) -> tuple[str, list[str]]:
    """xxh3 of the shard's ``size`` bytes and of each range of it (sorted by start; they may nest)."""
    whole = new_hasher()
    hashers = [blob_hasher(r.expected) for r in ranges]
    first = 0  # ranges before this one ended before the chunks to come
    position = 0
    for chunk in read_chunks(loc.fs, source.path, source.offset, size, local=loc.is_local):
        end = position + len(chunk)
        whole.update(chunk)
        while first < len(ranges) and ranges[first].start + ranges[first].nbytes <= position:
            first += 1
        k = first
        while k < len(ranges) and ranges[k].start < end:
            lo = max(ranges[k].start, position)
            hi = min(ranges[k].start + ranges[k].nbytes, end)
            if hi > lo:
                hashers[k].update(chunk[lo - position : hi - position])
            k += 1
        position = end
    return whole.hexdigest(), [h.hexdigest() for h in hashers]
