"""Part plans, S3 ETags and S3 CRC32 checksums, computed locally: pure functions, no I/O.

An upload is verified end to end without downloading it, by a value S3
reports for the object (HEAD) and the uploader computes from the local file
and the part plan:

- its CRC32 (asked for with ``ChecksumMode=ENABLED``; flexible checksums):
  for one PUT, the CRC32 of the body; for a multipart upload of N parts, the
  CRC32 of the concatenated 4-byte big-endian CRC32s of the parts, followed by
  ``-N`` (a "composite" checksum, :func:`crc32_of`). S3 checks each part's
  CRC32 as it arrives, and computes the object's from the parts it kept;
- its ETag, for servers without flexible checksums. For unencrypted (or
  SSE-S3) objects: for one PUT, the hex MD5 of the body; for a multipart
  upload, the hex MD5 of the concatenated binary MD5s of the parts, then
  ``-N`` (:func:`etag_of`). Objects encrypted with SSE-KMS or SSE-C have ETags
  that are not MD5s; :func:`is_md5_etag` tells them apart.

A downloader that can tell the part size (from the ETag's part count and the
object's size) checks the bytes it receives by their MD5s the same way.
A CRC32 is weaker than an MD5: it misses one random corruption in 2^32 (it
catches every burst of up to 32 bits), and two different files of the same
size pass for each other once in 2^32 comparisons (MD5 ETags: never in
practice). Downloads still check MD5s.
"""

from __future__ import annotations

import base64
import hashlib
import re
import zlib
from dataclasses import dataclass

MiB = 1 << 20
MIN_PART = 5 * MiB  # S3's smallest part (except the last)
MAX_PART = 5 << 30  # S3's largest part, and largest single PUT
MAX_PARTS = 10_000
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}(-[1-9][0-9]*)?$")
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
    """Split ``size`` bytes into parts of ``part_size`` (grown, if needed, to stay within 10,000 parts)."""
    if size <= part_size:
        return PartPlan(size, part_size, False, (Part(1, 0, size),))
    needed = -(-size // MAX_PARTS)
    part_size = max(part_size, -(-needed // MiB) * MiB)
    if part_size > MAX_PART:
        raise ValueError(f"{size} bytes do not fit in {MAX_PARTS} parts of at most 5 GiB")
    parts = tuple(
        Part(i + 1, off, min(part_size, size - off)) for i, off in enumerate(range(0, size, part_size))
    )
    return PartPlan(size, part_size, True, parts)


def etag_of(plan: PartPlan, md5s: list[bytes]) -> str:
    """The ETag S3 reports for an upload by ``plan`` whose parts have binary MD5s ``md5s``."""
    if len(md5s) != len(plan.parts):
        raise ValueError(f"{len(md5s)} part digests for a plan of {len(plan.parts)} parts")
    if not plan.multipart:
        return md5s[0].hex()
    return f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"


def crc32_of(plan: PartPlan, crcs: list[str]) -> str:
    """The ChecksumCRC32 S3 reports for an upload by ``plan`` whose parts have base64 CRC32s ``crcs``."""
    if len(crcs) != len(plan.parts):
        raise ValueError(f"{len(crcs)} part checksums for a plan of {len(plan.parts)} parts")
    if not plan.multipart:
        return crcs[0]
    crc = zlib.crc32(b"".join(base64.b64decode(c) for c in crcs))
    return f"{base64.b64encode(crc.to_bytes(4, 'big')).decode()}-{len(crcs)}"


def same_checksum(reported: str, expected: str) -> bool:
    """True when S3's ``reported`` checksum is ``expected``: the base64 value and, if reported, the ``-N``.

    S3 reports a composite checksum as ``<base64>-N``; moto leaves ``-N`` out.
    """
    value, _, parts = reported.strip().partition("-")
    want, _, want_parts = expected.partition("-")
    return value == want and (not parts or parts == want_parts)


def clean_etag(etag: str | None) -> str:
    """An ETag as S3 sends it (``"abc..."``, quoted) without its quotes."""
    return (etag or "").strip().strip('"').lower()


def is_md5_etag(etag: str) -> bool:
    """True when ``etag`` is an MD5 (or multipart MD5) ETag, which :func:`etag_of` can reproduce."""
    return bool(_MD5_ETAG.match(clean_etag(etag)))


def etag_parts(etag: str) -> int:
    """The part count of a multipart ETag; 0 for a single-PUT ETag."""
    _, dash, count = clean_etag(etag).partition("-")
    return int(count) if dash else 0


def guess_part_size(size: int, parts: int, hints: tuple[int, ...] = ()) -> int | None:
    """The part size a multipart object of ``size`` bytes in ``parts`` parts was uploaded with.

    Any part size p with ceil(size / p) == parts fits; the first of ``hints``
    (then of the sizes common uploaders use) that fits is returned, or None.
    """
    if parts < 1 or size < parts:
        return None
    for p in (*hints, *COMMON_PART_SIZES):
        if p > 0 and -(-size // p) == parts:
            return p
    return None


def plan_for_etag(size: int, etag: str, part_size: int) -> PartPlan | None:
    """The part plan an object of ``size`` bytes with this MD5 ``etag`` was uploaded by, if it can be told."""
    count = etag_parts(etag)
    if count == 0:
        return PartPlan(size, size, False, (Part(1, 0, size),))
    if count == 1:
        return PartPlan(size, size, True, (Part(1, 0, size),))
    p = guess_part_size(size, count, hints=(part_size,))
    return None if p is None else plan_parts(size, p)


def download_ranges(size: int, part_size: int, remote: PartPlan | None) -> list[list[Part]]:
    """Download ranges of about ``part_size`` bytes; made of whole remote parts when those are hashed."""
    if remote is None:
        return [[p] for p in plan_parts(max(size, 1), part_size).parts] if size else []
    k = max(1, part_size // max(remote.part_size, MiB))
    return [list(remote.parts[i : i + k]) for i in range(0, len(remote.parts), k)]
