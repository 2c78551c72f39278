"""Read blobs of a committed version back into tensors, verifying as it goes.

Only the blobs a caller asks for are read (a partial load touches only the
bytes of the tensors it returns). Each blob lands in a fresh uint8 tensor,
read in place on local disks by several threads at once, and its checksum is
compared with the manifest's before anything is returned. A shard shorter
than the manifest says, or bytes that do not match, raise
:class:`CorruptShardError` naming the file.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from .byteio import MAX_REQUEST, ReadRange, coalesce, empty_bytes, read_ranges
from .checksum import digest
from .errors import CorruptShardError
from .location import Location
from .manifest import Manifest

SPLIT = 64 << 20  # large blobs are read as several ranges, in parallel


def read_blobs(
    loc: Location,
    version_dir: str,
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
    jobs: list[tuple[str, list[ReadRange]]] = []
    for shard_index in sorted({manifest.blobs[i].shard for i in wanted}):
        shard = manifest.shards[shard_index]
        path = loc.path(version_dir, shard.file)
        if verify:
            check_size(loc, path, shard.size)
        ranges = [
            r
            for i in wanted
            if manifest.blobs[i].shard == shard_index
            for r in _ranges(manifest.blobs[i].offset, out[i])
        ]
        jobs.extend((path, batch) for batch in _batches(ranges, loc.is_local))
    _run(jobs, loc, threads)
    if verify:
        _parallel(threads, [partial(_check_blob, loc, version_dir, manifest, i, out[i]) for i in wanted])
    return out


def check_size(loc: Location, path: str, expected: int) -> None:
    try:
        actual = loc.fs.size(path)
    except FileNotFoundError:
        raise CorruptShardError(
            _display(loc, path), expected=f"{expected} bytes", actual="no file", what="size"
        ) from None
    if actual != expected:
        raise CorruptShardError(
            _display(loc, path), expected=f"{expected} bytes", actual=f"{actual} bytes", what="size"
        )


def _display(loc: Location, path: str) -> str:
    return loc.display(path[len(loc.root) :].lstrip("/")) if path.startswith(loc.root) else path


def _ranges(offset: int | None, buf: torch.Tensor) -> list[ReadRange]:
    if offset is None or buf.numel() == 0:
        return []
    view = buf.numpy().data
    return [ReadRange(offset + s, view[s : s + SPLIT]) for s in range(0, len(view), SPLIT)]


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


def _run(jobs: list[tuple[str, list[ReadRange]]], loc: Location, threads: int) -> None:
    def one(job: tuple[str, list[ReadRange]]) -> None:
        path, ranges = job
        try:
            read_ranges(loc.fs, path, ranges, local=loc.is_local)
        except FileNotFoundError:
            raise CorruptShardError(
                _display(loc, path), expected="a shard file", actual="no file", what="presence"
            ) from None
        except EOFError as exc:
            raise CorruptShardError(
                _display(loc, path), expected="more bytes", actual=str(exc), what="size"
            ) from None

    _parallel(threads, [partial(one, job) for job in jobs])


def _parallel(threads: int, calls: list[Callable[[], None]]) -> None:
    """Run ``calls`` on up to ``threads`` threads (I/O and xxh3 release the GIL); re-raise the first error."""
    if threads <= 1 or len(calls) <= 1:
        for call in calls:
            call()
        return
    with ThreadPoolExecutor(min(threads, len(calls)), thread_name_prefix="ckptflow-read") as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()


def _check_blob(loc: Location, version_dir: str, manifest: Manifest, i: int, data: torch.Tensor) -> None:
    blob = manifest.blobs[i]
    actual = digest(data.numpy().data) if data.numel() else digest(b"")
    if actual != blob.checksum:
        shard = manifest.shards[blob.shard].file
        raise CorruptShardError(
            f"{loc.display(version_dir, shard)} (dataset {blob.dataset})",
            expected=blob.checksum,
            actual=actual,
        )
