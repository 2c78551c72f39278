"""Moving bytes: tensor memory to files, and file ranges back into tensors.

This is the thin I/O layer under the writer and the reader. It takes tensors
and (path, offset, length) ranges; it knows nothing of manifests. On local
disks it uses plain ``os.write`` / ``os.preadv`` (which release the GIL, so
several threads really overlap) and fsyncs before a file counts as written.
On other filesystems it streams through fsspec, and reads coalesced ranges
so that many small tensors cost few requests.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import fsspec
from fsspec.spec import AbstractBufferedFile
from fsspec.utils import merge_offset_ranges

from ..errors import CheckpointError
from ..format.checksum import digest, new_hasher
from .localfs import open_regular

if TYPE_CHECKING:
    import torch

CHUNK = 8 << 20  # bytes per write/hash step: small enough to pipeline, big enough for syscalls
MAX_REQUEST = 64 << 20  # local reads: a job reads at most this many bytes
COALESCE_GAP = 1 << 20  # remote reads merge ranges separated by less than this
REMOTE_REQUEST = 16 << 20  # ... into requests of at most this many bytes (each held twice in flight)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t``'s elements, in row-major order, as a read-only view.

    Zero-copy for contiguous CPU tensors; a non-contiguous tensor is copied
    (only its own elements), a device tensor is copied to host memory.
    """
    nbytes = t.nbytes
    if nbytes == 0:
        return memoryview(b"")
    if t.device.type == "cpu" and t.is_contiguous():
        # The tensor's own memory (a third of the time of a uint8 view through numpy, per
        # tensor); the caller holds ``t`` while it uses the view.
        return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B").toreadonly()
    import torch

    copy = t.cpu().contiguous()  # the view below keeps this copy alive
    return copy.reshape(-1).view(torch.uint8).numpy().data.toreadonly()


def empty_bytes(nbytes: int) -> torch.Tensor:
    """A fresh uint8 tensor to read ``nbytes`` into."""
    import torch

    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except (RuntimeError, MemoryError):  # a manifest declaring more than the machine holds
        raise CheckpointError(
            f"cannot allocate the {nbytes} bytes a manifest declares: more than this machine can hold "
            "(a damaged or crafted manifest? `ckptflow verify` checks it against its files)"
        ) from None


class Sink(Protocol):
    def write(self, data: memoryview | bytes) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class LocalSink:
    """Sequential writes to a local file, fsynced on commit."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    def commit(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)

    def abort(self) -> None:
        os.close(self.fd)


class FsspecSink:
    """Streaming writes through fsspec (multipart upload on object stores)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, block_size: int = 8 << 20) -> None:
        self.file = fs.open(path, "wb", block_size=block_size)

    def write(self, data: memoryview | bytes) -> None:
        self.file.write(data)

    def commit(self) -> None:
        self.file.close()

    def abort(self) -> None:
        # Discard the buffered data; an object store creates no object.
        discard = getattr(self.file, "discard", None)
        if discard is not None:
            discard()
            if isinstance(self.file, AbstractBufferedFile):  # s3fs, gcsfs, ...
                self.file.closed = True  # else its __del__ flushes the discarded (None) buffer and fails
        else:
            self.file.close()


def open_sink(fs: fsspec.AbstractFileSystem, path: str, *, local: bool) -> Sink:
    return LocalSink(path) if local else FsspecSink(fs, path)


def write_hashed(
    sink: Sink, data: memoryview | bytes, *hashers, pieces: tuple[int, list[str]] | None = None
) -> None:
    """Write ``data`` in chunks, feeding every hasher as it goes; ``pieces`` (size, list): append
    the checksum of each piece of that size (a divisor of CHUNK) while the bytes are in cache."""
    view = memoryview(data)
    size, sums = pieces if pieces is not None else (CHUNK, None)
    if CHUNK % size:
        raise ValueError(f"pieces of {size} bytes do not divide the write chunk ({CHUNK} bytes)")
    for start in range(0, len(view), CHUNK):
        chunk = view[start : start + CHUNK]
        for h in hashers:
            h.update(chunk)
        if sums is not None:
            sums.extend(digest(chunk[p : p + size]) for p in range(0, len(chunk), size))
        sink.write(chunk)


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (local disks only)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ReadRange:
    offset: int
    out: memoryview  # writable, len == bytes to read


def read_ranges(fs: fsspec.AbstractFileSystem, path: str, ranges: list[ReadRange], *, local: bool) -> None:
    """Fill each range's buffer with the file's bytes at its offset."""
    if local:
        _read_local(fs, path, ranges)
    else:
        _read_remote(fs, path, ranges)


def _read_local(fs: fsspec.AbstractFileSystem, path: str, ranges: Iterable[ReadRange]) -> None:
    fd = open_regular(path, fs)
    try:
        for r in ranges:
            view, pos = r.out, r.offset
            while view:
                n = os.preadv(fd, [view], pos)
                if n == 0:
                    raise EOFError(f"{path} ends at byte {pos}, before the data the manifest lists")
                view, pos = view[n:], pos + n
    finally:
        os.close(fd)


HASH_CHUNK = 1 << 20  # read-and-hash step: small enough that the hash reads the bytes from the CPU cache


def read_hashed_local(fd: int, path: str, offset: int, out: memoryview, hasher: Any) -> str:
    """Fill ``out`` with the bytes of the file ``fd`` (at ``path``, opened by :func:`open_regular`)
    at ``offset`` and return their digest by ``hasher`` (a fresh xxhash object), in one pass.

    Each chunk is hashed right after it is read, while it is still in the CPU
    cache: one trip through memory instead of two (a third faster here).
    """
    for start in range(0, len(out), HASH_CHUNK):
        view, pos = out[start : start + HASH_CHUNK], offset + start
        chunk = view
        while view:
            n = os.preadv(fd, [view], pos)
            if n == 0:
                raise EOFError(f"{path} ends at byte {pos}, before the data the manifest lists")
            view, pos = view[n:], pos + n
        hasher.update(chunk)
    return hasher.hexdigest()


def _read_remote(fs: fsspec.AbstractFileSystem, path: str, ranges: list[ReadRange]) -> None:
    for group in coalesce(ranges):
        start = group[0].offset
        end = max(r.offset + len(r.out) for r in group)
        data = fs.cat_file(path, start=start, end=end)
        if len(data) != end - start:
            raise EOFError(f"{path} ends before byte {end}, where the manifest lists data")
        view = memoryview(data)
        for r in group:
            r.out[:] = view[r.offset - start : r.offset - start + len(r.out)]


def coalesce(ranges: list[ReadRange]) -> list[list[ReadRange]]:
    """Ranges grouped (by fsspec's ``merge_offset_ranges``) so that each group is one request of
    nearby bytes, at most REMOTE_REQUEST long unless one range is longer."""
    ranges = sorted(ranges, key=lambda r: r.offset)
    if not ranges:
        return []
    starts = [r.offset for r in ranges]
    ends = [r.offset + len(r.out) for r in ranges]
    _, _, group_ends = merge_offset_ranges(
        [""] * len(ranges), starts, ends, max_gap=COALESCE_GAP, max_block=REMOTE_REQUEST, sort=False
    )
    groups: list[list[ReadRange]] = [[] for _ in group_ends]
    g = 0
    for r, end in zip(ranges, ends, strict=True):
        while end > group_ends[g]:
            g += 1
        groups[g].append(r)
    return [group for group in groups if group]


def hash_range(fs: fsspec.AbstractFileSystem, path: str, offset: int, size: int, *, local: bool) -> str:
    """xxh3 of ``size`` bytes of a file from ``offset`` (a shard, or a tarball member), streamed."""
    h = new_hasher()
    for chunk in read_chunks(fs, path, offset, size, local=local):
        h.update(chunk)
    return h.hexdigest()


def read_chunks(
    fs: fsspec.AbstractFileSystem, path: str, offset: int, size: int, *, local: bool
) -> Iterator[memoryview]:
    """``size`` bytes of a file from ``offset``, in order, in chunks (each valid until the next one
    is asked for); EOFError if the file is shorter."""
    done = 0
    if local:
        buf = bytearray(min(CHUNK, max(size, 1)))
        fd = open_regular(path, fs)
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
        chunk = fs.cat_file(path, start=offset + done, end=offset + done + n)
        if not chunk:
            raise EOFError(f"{path} ends at byte {offset + done}")
        yield memoryview(chunk)
        done += len(chunk)


def hash_file(fs: fsspec.AbstractFileSystem, path: str, *, local: bool) -> tuple[int, str]:
    """Size and checksum of a whole file, streamed."""
    size = os.path.getsize(path) if local else fs.size(path)
    return size, hash_range(fs, path, 0, size, local=local)
