"""Blocking work on a file's byte ranges, run in a transfer's thread pool beside the event loop.

A slice of a file sent as a request body without holding it in memory, the MD5 and
CRC32 of a range, and positioned writes that feed each part's hasher as the bytes
of a download stream in. Nothing here touches the network.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import zlib
from typing import Any

from .etag import MiB, Part


class FileSlice(io.RawIOBase):
    """A seekable, read-only view of ``length`` bytes of a file at ``offset``: a request body.

    botocore reads it to sign and checksum it, aiohttp to send it, and seeks
    back to 0 to retry; nothing holds the whole part in memory.
    """

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def __len__(self) -> int:
        return self.length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def read(self, size: int | None = -1) -> bytes:
        want = self.length - self.pos if size is None or size < 0 else min(size, self.length - self.pos)
        data = os.pread(self.fd, want, self.offset + self.pos) if want > 0 else b""
        if len(data) < want and not data:
            raise EOFError(f"the file ended at byte {self.offset + self.pos} while it was being uploaded")
        self.pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def md5_range(fd: int, offset: int, length: int) -> bytes:
    h = hashlib.md5()
    for pos in range(offset, offset + length, 8 * MiB):
        data = os.pread(fd, min(8 * MiB, offset + length - pos), pos)
        if not data:
            raise EOFError(f"the file ended at byte {pos} while it was being read")
        h.update(data)
    return h.digest()


def crc32_range(fd: int, offset: int, length: int) -> str:
    """The CRC32 of a file range, base64-encoded as S3's ``x-amz-checksum-crc32`` wants it."""
    crc = 0
    for pos in range(offset, offset + length, 8 * MiB):
        crc = zlib.crc32(os.pread(fd, min(8 * MiB, offset + length - pos), pos), crc)
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def write_hashed(fd: int, data: bytes, pos: int, parts: list[Part], hashers: list) -> None:
    """pwrite ``data`` at ``pos``; feed each part's hasher the bytes that fall in that part."""
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written:], pos + written)
    for part, h in zip(parts, hashers, strict=False):  # no hashers: nothing to feed
        lo, hi = max(part.offset, pos), min(part.offset + part.length, pos + len(view))
        if lo < hi:
            h.update(view[lo - pos : hi - pos])
