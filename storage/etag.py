"""Part plans and S3 ETags, computed locally: pure functions, no I/O.

An upload is verified end to end without downloading it: S3 reports for every
object an ETag that, for unencrypted (or SSE-S3) objects, is a function of its
bytes and of how they were uploaded:

- one PUT: the hex MD5 of the body;
- a multipart upload of N parts: the hex MD5 of the concatenated binary MD5s
  of the parts, followed by ``-N``.

So the uploader computes the same value from the local file and the part plan
and compares it with the ETag of a HEAD request. A downloader that can tell
the part size (from the ETag's part count and the object's size) checks the
bytes it receives the same way. Objects encrypted with SSE-KMS or SSE-C have
ETags that are not MD5s; :func:`is_md5_etag` tells them apart.
"""

from __future__ import annotations

import hashlib
import re
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
