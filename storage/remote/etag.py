"""What S3 reports about an object's bytes, computed locally: part plans, ETags, CRC32s.

An upload is verified end to end without downloading it, by a value a HEAD
reports and the uploader computes from the local file:

- its CRC32 (``ChecksumMode=ENABLED``). ckptflow uploads with a full-object
  CRC32 (``ChecksumType=FULL_OBJECT``): the CRC32 of the whole file, which the
  server checks when it completes the upload. Other uploaders' multipart
  objects carry a composite one: the CRC32 of the parts' 4-byte CRC32s,
  followed by ``-N`` (:func:`crc32_of`);
- its ETag, from servers without flexible checksums: the hex MD5 of one PUT's
  body, or for N parts the MD5 of the parts' binary MD5s, then ``-N``
  (:func:`etag_of`). SSE-KMS and SSE-C ETags are no MD5s.

A composite value needs the part plan, told from the object's size and the
ETag's part count (:func:`plan_for_etag`).
"""

from __future__ import annotations

import base64
import hashlib
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..files.s3options import MiB

MAX_PARTS = 10_000
COMMON_PART_SIZES = tuple(n * MiB for n in (5, 8, 10, 16, 32, 50, 64, 100, 128, 256, 512))


@dataclass(frozen=True)
class Part:
    number: int  # 1-based, as S3 numbers parts
    offset: int
    length: int


@dataclass(frozen=True)
class PartPlan:
    size: int
    part_size: int
    multipart: bool  # False: one PUT of the whole file
    parts: tuple[Part, ...]


def plan_parts(size: int, part_size: int) -> PartPlan:
    """Split ``size`` bytes into parts of ``part_size``, grown as boto3 grows it (doubled until
    10,000 parts hold the file): the plan boto3's uploads follow."""
    if size <= part_size:
        return PartPlan(size, part_size, False, (Part(1, 0, size),))
    from s3transfer.utils import ChunksizeAdjuster

    part_size = ChunksizeAdjuster().adjust_chunksize(part_size, size)
    parts = tuple(Part(i + 1, o, min(part_size, size - o)) for i, o in enumerate(range(0, size, part_size)))
    return PartPlan(size, part_size, True, parts)


def etag_of(plan: PartPlan, md5s: list[bytes]) -> str:
    """The ETag S3 reports for an upload by ``plan`` whose parts have binary MD5s ``md5s``."""
    if len(md5s) != len(plan.parts):
        raise ValueError(f"{len(md5s)} part digests for a plan of {len(plan.parts)} parts")
    if not plan.multipart:
        return md5s[0].hex()
    return f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"


def crc32_of(plan: PartPlan, crcs: list[str]) -> str:
    """The composite CRC32 S3 reports for an upload by ``plan`` whose parts have base64 CRC32s ``crcs``."""
    if len(crcs) != len(plan.parts):
        raise ValueError(f"{len(crcs)} part checksums for a plan of {len(plan.parts)} parts")
    if not plan.multipart:
        return crcs[0]
    crc = zlib.crc32(b"".join(base64.b64decode(c) for c in crcs))
    return f"{b64(crc)}-{len(crcs)}"


def same_checksum(reported: str, expected: str) -> bool:
    """True when ``reported`` is ``expected``: the base64 value and, if reported, the ``-N``
    (moto leaves ``-N`` off)."""
    value, _, parts = reported.strip().partition("-")
    want, _, want_parts = expected.partition("-")
    return value == want and (not parts or parts == want_parts)


def clean_etag(etag: str | None) -> str:
    """An ETag as S3 sends it (``"abc..."``, quoted) without its quotes."""
    return (etag or "").strip().strip('"').lower()


def etag_parts(etag: str) -> int:
    """The part count of a multipart ETag; 0 for a single-PUT ETag."""
    _, dash, count = clean_etag(etag).partition("-")
    return int(count) if dash and count.isdigit() else 0


def guess_part_size(size: int, parts: int, hints: tuple[int, ...] = ()) -> int | None:
    """The part size of a multipart object of ``size`` bytes in ``parts`` parts: the first of
    ``hints``, then of the sizes common uploaders use, with ceil(size / p) == parts; else None."""
    if parts < 1 or size < parts:
        return None
    return next((p for p in (*hints, *COMMON_PART_SIZES) if p > 0 and -(-size // p) == parts), None)


def plan_for_etag(size: int, etag: str, part_size: int) -> PartPlan | None:
    """The part plan an object of ``size`` bytes with this ``etag`` was uploaded by, if it can be told."""
    count = etag_parts(etag)
    if count <= 1:  # one PUT, or a multipart upload of one part
        return PartPlan(size, size, count == 1, (Part(1, 0, size),))
    grown = plan_parts(size, part_size).part_size  # as boto3 grows it past 10,000 parts
    p = guess_part_size(size, count, hints=(part_size, grown))
    return None if p is None else plan_parts(size, p)


def b64(crc: int) -> str:
    """A CRC32 as S3's ``x-amz-checksum-crc32`` carries it: base64 of 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def crc32_range(fd: int, offset: int, length: int) -> str:
    """The base64 CRC32 of a file range."""
    return b64(_fold(fd, offset, length, zlib.crc32, 0))


def md5_range(fd: int, offset: int, length: int) -> bytes:
    h = hashlib.md5()
    _fold(fd, offset, length, lambda data, _: h.update(data), None)
    return h.digest()


def _fold(fd: int, offset: int, length: int, step: Callable[[bytes, Any], Any], acc: Any) -> Any:
    for pos in range(offset, offset + length, 8 * MiB):
        data = os.pread(fd, min(8 * MiB, offset + length - pos), pos)
        if not data:
            raise EOFError(f"the file ended at byte {pos} while it was being read")
        acc = step(data, acc)
    return acc
