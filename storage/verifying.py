"""Verify a version: every byte against every checksum its manifest holds.

A manifest has two levels of checksums: each shard file's, and each blob's
(the bytes of one tensor inside its shard, what ``load`` checks). ``verify``
checks both, so a version that verifies also loads. Each shard is read once,
front to back: the chunk that feeds the shard's hasher also feeds the hashers
of the blobs it overlaps.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from .byteio import CHUNK, MAX_REQUEST
from .checksum import new_hasher
from .errors import CorruptShardError
from .location import Location
from .manifest import BlobEntry, Manifest
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
    for chunk in _chunks(loc, source.path, source.offset, size):
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


def _chunks(loc: Location, path: str, offset: int, size: int) -> Iterator[memoryview]:
    """``size`` bytes of a file from ``offset``, in chunks; EOFError if the file is shorter."""
    done = 0
    if loc.is_local:
        buf = bytearray(min(CHUNK, max(size, 1)))
        fd = os.open(path, os.O_RDONLY)
        try:
            while done < size:
                n = os.preadv(fd, [memoryview(buf)[: min(len(buf), size - done)]], offset + done)
                if n == 0:
                    raise EOFError(f"{path} ends at byte {offset + done}")
                yield memoryview(buf)[:n]
                done += n
        finally:
            os.close(fd)
        return
    while done < size:
        n = min(MAX_REQUEST, size - done)
        data = loc.fs.cat_file(path, start=offset + done, end=offset + done + n)
        if not data:
            raise EOFError(f"{path} ends at byte {offset + done}")
        yield memoryview(data)
        done += len(data)
