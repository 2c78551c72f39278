"""Verify a version: every byte against every checksum its manifest holds.

A manifest has two levels of checksums: each shard file's, and each blob's
(the bytes of one tensor inside its shard, what ``load`` checks). ``verify``
checks both, so a version that verifies also loads. Each shard is read once,
front to back: the chunk that feeds the shard's hasher also feeds the hashers
of the blobs it overlaps.
"""

from __future__ import annotations

from ..errors import CorruptShardError
from ..files.byteio import read_chunks
from ..files.location import Location
from ..format.checksum import new_hasher
from ..format.manifest import BlobEntry, Manifest
from .reader import ShardSource, check_size


def verify_version(loc: Location, manifest: Manifest, sources: list[ShardSource]) -> None:
    """Raise :class:`CorruptShardError` naming the first shard or blob whose bytes do not match."""
    blobs = [*manifest.blobs, *(b for part in manifest.ranks for b in part.blobs)]
    for index, (shard, source) in enumerate(zip(manifest.shards, sources, strict=True)):
        check_size(loc, source)
        inside = sorted(
            (b for b in blobs if b.shard == index and b.offset is not None and b.nbytes), key=_start
        )
        whole, parts = _digests(loc, source, shard.size, inside)
        if whole != shard.checksum:
            raise CorruptShardError(source.name, expected=shard.checksum, actual=whole)
        for blob, actual in zip(inside, parts, strict=True):
            if actual != blob.checksum:
                raise CorruptShardError(
                    f"{source.name} (dataset {blob.dataset})", expected=blob.checksum, actual=actual
                )


def _start(blob: BlobEntry) -> int:
    return blob.offset or 0


def _digests(loc: Location, source: ShardSource, size: int, blobs: list[BlobEntry]) -> tuple[str, list[str]]:
    """xxh3 of the shard's ``size`` bytes and of each blob's range in it (blobs sorted by offset)."""
    whole = new_hasher()
    hashers = [new_hasher() for _ in blobs]
    first = 0  # the first blob that may still overlap the chunks to come
    position = 0
    for chunk in read_chunks(loc.fs, source.path, source.offset, size, local=loc.is_local):
        end = position + len(chunk)
        whole.update(chunk)
        while first < len(blobs) and _start(blobs[first]) + blobs[first].nbytes <= position:
            first += 1
        k = first
        while k < len(blobs) and _start(blobs[k]) < end:
            lo = max(_start(blobs[k]), position)
            hi = min(_start(blobs[k]) + blobs[k].nbytes, end)
            if hi > lo:
                hashers[k].update(chunk[lo - position : hi - position])
            k += 1
        position = end
    return whole.hexdigest(), [h.hexdigest() for h in hashers]
