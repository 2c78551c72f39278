"""Read blobs of a committed version back into tensors, verifying as it goes.

Only the blobs a caller asks for are read (a partial load touches only the
bytes of the tensors it returns). Each blob lands in a fresh uint8 tensor,
read in place on local disks by several threads at once, and its checksum is
compared with the manifest's before anything is returned. A shard shorter
than the manifest says, or bytes that do not match, raise
:class:`CorruptShardError` naming the file.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from ..errors import CorruptShardError
from ..files.byteio import (
    MAX_REQUEST,
    REMOTE_REQUEST,
    ReadRange,
    coalesce,
    empty_bytes,
    read_hashed_local,
    read_ranges,
)
from ..files.localfs import open_regular
from ..files.location import Location
from ..files.sources import ShardSource
from ..format.checksum import blob_digest, blob_hasher, new_hasher
from ..format.manifest import BlobEntry, Manifest

if TYPE_CHECKING:
    import torch

SPLIT = 64 << 20  # large blobs are read as several ranges, in parallel
FUSED_MAX = 256 << 20  # verified local blobs up to this size are read and hashed in one pass
SMALL = 64 << 10  # neighbouring blobs up to this size are read together ...
GAP = 4 << 10  # ... when at most this many bytes lie between them ...
BATCH = 4 << 20  # ... in requests of up to this many bytes


def read_blobs(
    loc: Location,
    sources: list[ShardSource],
    manifest: Manifest,
    wanted: list[int],
    *,
    verify: bool,
    threads: int,
    buffers: dict[int, torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """uint8 tensors holding the bytes of the ``wanted`` blobs (``buffers``: where to put some)."""
    given = buffers or {}
    out = {i: given[i] if i in given else empty_bytes(manifest.blobs[i].nbytes) for i in wanted}
    # Local and verified: each blob up to FUSED_MAX is read and hashed in one pass (see
    # read_hashed_local), its blobs spread over the threads by size. Larger blobs are read
    # in SPLIT-sized ranges by several threads and hashed afterwards.
    fused = [
        i
        for i in wanted
        if verify
        and loc.is_local
        and manifest.blobs[i].offset is not None
        and 0 < manifest.blobs[i].nbytes <= FUSED_MAX
    ]
    fused_set = set(fused)
    rest = [i for i in wanted if i not in fused_set]
    jobs: list[Callable[[], None]] = []
    for shard_index in sorted({manifest.blobs[i].shard for i in wanted}):
        source = sources[shard_index]
        if verify:
            check_size(loc, source)
        ranges = [
            r
            for i in rest
            if manifest.blobs[i].shard == shard_index
            for r in _ranges(_offset(source, manifest.blobs[i].offset), out[i], loc.is_local)
        ]
        jobs.extend(partial(_read_job, loc, source, batch) for batch in _batches(ranges, loc.is_local))
    for runs in _spread(fused, manifest, threads):
        jobs.append(partial(_read_and_check, loc.fs, sources, manifest, runs, out))
    _parallel(threads, jobs)
    if verify:
        _parallel(threads, [partial(_check_blob, sources, manifest, i, out[i]) for i in rest])
    return out


@dataclass(frozen=True)
class Span:
    """Bytes ``start``..``end`` of blob ``blob``: the part of a chunk that a load needs."""

    blob: int
    start: int
    end: int


@dataclass(frozen=True)
class _Window:
    """What is read for a span: bytes ``lo``..``hi`` of its blob, as consecutive parts."""

    lo: int
    parts: list[tuple[int, torch.Tensor]]  # (where in the blob, uint8 buffer), in order, lo..hi
    result: torch.Tensor  # the span's own bytes


def read_spans(
    loc: Location,
    sources: list[ShardSource],
    manifest: Manifest,
    spans: list[Span],
    *,
    verify: bool,
    threads: int,
    into: dict[int, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """uint8 tensors holding the bytes of each span (``into``: span index -> where to put them).

    Verified, a span is read out to the edges of its blob's pieces and each piece is checked
    (the whole blob, for a blob without pieces): the bytes around the span go to buffers of
    their own, the span's straight where it belongs. Unverified, exactly the span is read.
    """
    given = into or {}
    windows = [_window(manifest, span, verify, given.get(i)) for i, span in enumerate(spans)]
    jobs: list[Callable[[], None]] = []
    for shard_index in sorted({manifest.blobs[s.blob].shard for s in spans}):
        source = sources[shard_index]
        if verify:
            check_size(loc, source)
        ranges = [
            r
            for span, window in zip(spans, windows, strict=True)
            if manifest.blobs[span.blob].shard == shard_index
            for at, buf in window.parts
            for r in _ranges(_offset(source, _start(manifest, span.blob, at)), buf, loc.is_local)
        ]
        jobs.extend(partial(_read_job, loc, source, batch) for batch in _batches(ranges, loc.is_local))
    _parallel(threads, jobs)
    if verify:
        checks: list[Callable[[], None]] = [
            partial(_check_window, sources, manifest, span.blob, window)
            for span, window in zip(spans, windows, strict=True)
        ]
        _parallel(threads, checks)
    return [window.result for window in windows]


def _window(manifest: Manifest, span: Span, verify: bool, into: torch.Tensor | None) -> _Window:
    """The bytes of the blob to read for ``span`` (whole pieces when verified), and where to."""
    blob = manifest.blobs[span.blob]
    start, end = span.start, span.end
    if not (0 <= start <= end <= blob.nbytes):
        raise ValueError(f"bytes {start}..{end} are not inside blob {span.blob} ({blob.nbytes} bytes)")
    if into is not None and into.numel() != end - start:
        raise ValueError(f"a buffer of {into.numel()} bytes for a span of {end - start}")
    lo, hi = start, end
    size = blob.piece_bytes
    if verify and size is None:
        lo, hi = 0, blob.nbytes
    elif verify and size is not None:
        lo, hi = start // size * size, min(-(-end // size) * size, blob.nbytes)
    if into is None:
        buf = empty_bytes(hi - lo)
        return _Window(lo, [(lo, buf)], buf[start - lo : end - lo])
    parts = [(lo, empty_bytes(start - lo))] if lo < start else []
    parts.append((start, into))
    if end < hi:
        parts.append((end, empty_bytes(hi - end)))
    return _Window(lo, parts, into)


def _start(manifest: Manifest, blob: int, at: int) -> int | None:
    offset = manifest.blobs[blob].offset
    return None if offset is None else offset + at


def _check_window(sources: list[ShardSource], manifest: Manifest, i: int, window: _Window) -> None:
    """Check each piece the window covers (or the whole blob, for a blob without pieces)."""
    blob = manifest.blobs[i]
    end = window.parts[-1][0] + window.parts[-1][1].numel()
    if blob.piece_bytes is None or blob.pieces is None:
        pieces = [(0, blob.nbytes, blob.checksum, f"dataset {blob.dataset}")]
    else:
        size = blob.piece_bytes
        pieces = [
            (k * size, min((k + 1) * size, blob.nbytes), blob.pieces[k], f"dataset {blob.dataset}, piece {k}")
            for k in range(window.lo // size, -(-end // size))
        ]
    for lo, hi, expected, what in pieces:
        hasher = blob_hasher(expected)
        for at, buf in window.parts:
            a, b = max(lo, at), min(hi, at + buf.numel())
            if b > a:
                hasher.update(buf[a - at : b - at].numpy().data)
        actual = hasher.hexdigest()
        if actual != expected:
            raise CorruptShardError(f"{sources[blob.shard].name} ({what})", expected=expected, actual=actual)


def _spread(blobs: list[int], manifest: Manifest, bins: int) -> list[list[list[int]]]:
    """Blob indices in ``bins`` groups of about equal bytes (largest first into the lightest), as
    runs: neighbouring small blobs of a shard go to one group together, read in one request."""
    groups: list[list[list[int]]] = [[] for _ in range(max(1, bins))]
    loads = [0] * len(groups)
    runs = _runs(blobs, manifest)
    sizes = [sum(manifest.blobs[i].nbytes for i in run) for run in runs]
    for k in sorted(range(len(runs)), key=lambda k: -sizes[k]):
        target = loads.index(min(loads))
        groups[target].append(runs[k])
        loads[target] += sizes[k]
    return [sorted(g, key=lambda run: _position(manifest, run[0])) for g in groups if g]


def _position(manifest: Manifest, i: int) -> tuple[int, int]:
    return manifest.blobs[i].shard, manifest.blobs[i].offset or 0


def _runs(blobs: list[int], manifest: Manifest) -> list[list[int]]:
    """``blobs`` in file order, cut into runs: consecutive small blobs of one shard with little
    between them, up to BATCH bytes; a larger blob is a run of its own."""
    runs: list[list[int]] = []
    end, shard, size = -1, -1, 0
    for i in sorted(blobs, key=lambda i: _position(manifest, i)):
        blob = manifest.blobs[i]
        offset = blob.offset or 0
        joins = (
            blob.nbytes <= SMALL
            and runs
            and blob.shard == shard
            and 0 <= offset - end <= GAP
            and size + blob.nbytes <= BATCH
            and manifest.blobs[runs[-1][-1]].nbytes <= SMALL
        )
        if joins:
            runs[-1].append(i)
            size += offset - end + blob.nbytes
        else:
            runs.append([i])
            size = blob.nbytes
        end, shard = offset + blob.nbytes, blob.shard
    return runs


def _read_and_check(
    fs: Any,
    sources: list[ShardSource],
    manifest: Manifest,
    runs: list[list[int]],
    out: dict[int, torch.Tensor],
) -> None:
    """Read and hash the blobs of ``runs`` (sorted by shard), each shard opened once; a run of
    several small blobs is read in one request, then each blob copied out and checked."""
    for shard, group in itertools.groupby(runs, key=lambda run: manifest.blobs[run[0]].shard):
        source = sources[shard]
        with _shard_errors(source):
            fd = open_regular(source.path, fs)
            try:
                for run in group:
                    if len(run) == 1:
                        blob = manifest.blobs[run[0]]
                        offset = _offset(source, blob.offset)
                        assert offset is not None
                        actual = read_hashed_local(
                            fd, source.path, offset, out[run[0]].numpy().data, blob_hasher(blob.checksum)
                        )
                        _compare(source, blob, actual)
                        continue
                    first, last = manifest.blobs[run[0]], manifest.blobs[run[-1]]
                    start = _offset(source, first.offset)
                    assert start is not None and last.offset is not None and first.offset is not None
                    span = bytearray(last.offset + last.nbytes - first.offset)
                    read_hashed_local(fd, source.path, start, memoryview(span), new_hasher())
                    view = memoryview(span)
                    for i in run:
                        blob = manifest.blobs[i]
                        at = (blob.offset or 0) - first.offset
                        data = view[at : at + blob.nbytes]
                        out[i].numpy().data[:] = data
                        _compare(source, blob, blob_digest(data, blob.checksum))
            finally:
                os.close(fd)


def _compare(source: ShardSource, blob: BlobEntry, actual: str) -> None:
    if actual != blob.checksum:
        raise CorruptShardError(
            f"{source.name} (dataset {blob.dataset})", expected=blob.checksum, actual=actual
        )


def _offset(source: ShardSource, offset: int | None) -> int | None:
    return None if offset is None else source.offset + offset


def check_size(loc: Location, source: ShardSource) -> None:
    try:
        actual = loc.fs.size(source.path)
    except FileNotFoundError:
        raise CorruptShardError(
            source.name, expected=f"{source.file_size} bytes", actual="no file", what="size"
        ) from None
    if actual != source.file_size:
        raise CorruptShardError(
            source.name, expected=f"{source.file_size} bytes", actual=f"{actual} bytes", what="size"
        )


def _ranges(offset: int | None, buf: torch.Tensor, local: bool) -> list[ReadRange]:
    """``buf``'s bytes as ranges to read in parallel: SPLIT long from a local file, REMOTE_REQUEST
    from an object store (each remote request in flight holds its bytes twice)."""
    if offset is None or buf.numel() == 0:
        return []
    view = buf.numpy().data
    split = SPLIT if local else REMOTE_REQUEST
    return [ReadRange(offset + s, view[s : s + split]) for s in range(0, len(view), split)]


def _batches(ranges: list[ReadRange], local: bool) -> list[list[ReadRange]]:
    """Group small ranges so one job reads about ``MAX_REQUEST`` bytes."""
    if not local:
        return coalesce(ranges)
    batches: list[list[ReadRange]] = []
    size = MAX_REQUEST
    for r in sorted(ranges, key=lambda r: r.offset):
        if size + len(r.out) > MAX_REQUEST:
            batches.append([])
            size = 0
        batches[-1].append(r)
        size += len(r.out)
    return batches


def _read_job(loc: Location, source: ShardSource, ranges: list[ReadRange]) -> None:
    with _shard_errors(source):
        read_ranges(loc.fs, source.path, ranges, local=loc.is_local)


@contextmanager
def _shard_errors(source: ShardSource) -> Iterator[None]:
    """A missing or short shard file, as CorruptShardError naming it."""
    try:
        yield
    except FileNotFoundError:
        raise CorruptShardError(
            source.name, expected="a shard file", actual="no file", what="presence"
        ) from None
    except EOFError as exc:
        raise CorruptShardError(source.name, expected="more bytes", actual=str(exc), what="size") from None


def _parallel(threads: int, calls: list[Callable[[], None]]) -> None:
    """Run ``calls`` on up to ``threads`` threads (I/O and xxh3 release the GIL); re-raise the first error."""
    if threads <= 1 or len(calls) <= 1:
        for call in calls:
            call()
        return
    with ThreadPoolExecutor(min(threads, len(calls)), thread_name_prefix="ckptflow-read") as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()


def _check_blob(sources: list[ShardSource], manifest: Manifest, i: int, data: torch.Tensor) -> None:
    blob = manifest.blobs[i]
    actual = blob_digest(data.numpy().data if data.numel() else b"", blob.checksum)
    if actual != blob.checksum:
        raise CorruptShardError(
            f"{sources[blob.shard].name} (dataset {blob.dataset})",
            expected=blob.checksum,
            actual=actual,
        )
