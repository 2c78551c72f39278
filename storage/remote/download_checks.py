"""How a download is checked as it streams in: per-part hashers and the digest S3 reports.

A CRC32 object is checked by the CRC32s of its parts (zlib, on the I/O threads); an
object without CRC32 whose ETag is MD5s by the MD5s behind its ETag (on the capped hash
threads); any other only by size. Each ``Check`` says how to hash a part, how to hash
the whole file, and how to combine and compare the digests.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .etag import Part, PartPlan, crc32_of, etag_of, same_checksum
from .file_ranges import crc32_range, md5_range


@dataclass(frozen=True)
class Head:
    """What a HEAD of an object says about its bytes."""

    size: int
    etag: str  # without quotes
    md5_etag: bool  # False for SSE-KMS / SSE-C objects, whose ETag is not an MD5
    crc: str | None = None  # ChecksumCRC32 ("<base64>" or "<base64>-N"); None: not asked for, or none
    full_object: bool = False  # the CRC32 is of the whole object even if multipart (ChecksumType)


class Runs(Protocol):
    """Where hashing runs: a transfer's I/O threads (``run``) or its capped hash threads (``hash``)."""

    def run(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]: ...

    def hash(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]: ...


class Crc32:
    """A running CRC32 with hashlib's update/digest."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(4, "big")


@dataclass(frozen=True)
class Check:
    """How a download is checked: against the object's CRC32, or the MD5s behind its ETag."""

    name: str  # as errors name it
    new: Callable[[], Any]  # a hasher of one part
    whole_file: Callable[[int, int, int], bytes]  # (fd, offset, length) -> digest, from the file
    expected: Callable[[Head], str]
    combine: Callable[[PartPlan, list[bytes]], str]
    same: Callable[[str, str], bool]
    heavy: bool  # True: hashing runs on the capped hash threads (MD5), else on the I/O threads

    def runner(self, xfer: Runs) -> Callable[..., Awaitable[Any]]:
        return xfer.hash if self.heavy else xfer.run

    async def whole(self, xfer: Runs, fd: int, size: int) -> bytes:
        return await self.runner(xfer)(self.whole_file, fd, 0, size)


class Cursor:
    """Where a range download stands: the next byte to fetch, and the running hash of each part."""

    def __init__(self, parts: list[Part], check: Check | None) -> None:
        self.parts = parts
        self.check = check
        self.pos = parts[0].offset
        self.end = parts[-1].offset + parts[-1].length
        self.hashers = [check.new() for _ in parts] if check is not None else []


def crc32_digest(fd: int, offset: int, length: int) -> bytes:
    return base64.b64decode(crc32_range(fd, offset, length))


CRC32 = Check(
    "CRC32",
    Crc32,
    crc32_digest,
    lambda head: head.crc or "",
    lambda plan, digests: crc32_of(plan, [base64.b64encode(d).decode() for d in digests]),
    same_checksum,
    heavy=False,
)
MD5 = Check("ETag", hashlib.md5, md5_range, lambda head: head.etag, etag_of, lambda a, b: a == b, heavy=True)


def checker(head: Head) -> Check | None:
    if head.crc:
        return CRC32
    return MD5 if head.md5_etag else None
