"""A tarball's tar structure, checked against its index: what tar and extraction read besides the data.

The index's member checksums cover the members' data. Everything else in the
tarball is structure: before each member's data its header blocks (a PAX
extended header when a name or size does not fit the ustar fields, then the
ustar header), after its data zeros to the next 512-byte block, and after the
last member the end of the archive (at least two zero blocks, then zeros to a
whole record). GNU tar, Python's ``tarfile`` and extraction read that
structure: one flipped bit in a header makes GNU tar refuse the file or skip
members while every member's data still matches its checksum.

What must always hold: a tarball that passes :func:`check_tarball` is the tar
that was archived, outside the members' data, which the member checksums
cover; together they account for every byte.

- Each header block passes its own checksum (the ustar ``chksum`` field), and
  the blocks between two members' data describe exactly one regular file, with
  the index's name and size, whose data starts at the index's offset (PAX and
  GNU long-name headers are read; any other kind of header is a finding).
- With an index of format 3, the xxh3 of each member's header blocks matches
  the one recorded when it was written: this catches any change, even one the
  tar checksum (a plain sum of the bytes) misses. An older index is checked by
  parsing alone.
- The padding after each member's data and the end of the archive are zeros;
  the tarball has the size its index records.

Only these bytes are read (a block or two per member, as one batch of range
reads, concurrent on object stores), never the data again, so the check costs
a few KiB per member however big the tarball is. ``verify`` checks the whole
tarball (:func:`check_tarball`); loading or extracting a version checks the
headers of its own members (:func:`check_members`), so an intact version can
still be loaded or extracted, and so rescued, from a tarball damaged elsewhere.
A finding is a :class:`CorruptArchiveError` naming the tarball, the member
and what to do.
"""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass, replace
from typing import NoReturn

from ..errors import CorruptArchiveError
from ..files.localfs import open_regular
from ..files.location import Location
from ..format.checksum import digest
from .tarindex import BLOCK, IndexEntry, TarIndex, stored_size

_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE)
_PAX = (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE)  # extended header of the next member
_ZERO_BLOCK = bytes(BLOCK)


@dataclass(frozen=True)
class Finding:
    """What is wrong in one part of a tarball's structure."""

    part: str  # e.g. "the header of member v000007/shard-r0-00.h5 (bytes 7168-7680)"
    expected: str
    actual: str


@dataclass(frozen=True)
class Gap:
    """The bytes between the data of two members: the padding of the previous one, then the next
    one's header blocks (before the first member: its header blocks alone)."""

    start: int  # where the previous member's data ends (0 before the first member)
    entry: IndexEntry  # the member whose data follows
    previous: str | None  # the previous member's name


def gaps(index: TarIndex) -> list[Gap]:
    """The gap before each member of ``index``, in tar order."""
    found: list[Gap] = []
    start, previous = 0, None
    for entry in index.members:
        found.append(Gap(start, entry, previous))
        start, previous = entry.offset + entry.size, entry.name
    return found


def end_start(index: TarIndex) -> int:
    """Where the last member's data ends: the padding and the end-of-archive blocks follow."""
    last = index.members[-1] if index.members else None
    return last.offset + last.size if last is not None else 0


# -- pure checks of bytes already read --------------------------------------------------------------


def gap_finding(gap: Gap, data: bytes) -> Finding | None:
    """What is wrong with the bytes of ``gap`` (``data``: from ``gap.start`` to the member's offset)."""
    entry = gap.entry
    pad = -gap.start % BLOCK
    part = f"the header of member {entry.name} (bytes {gap.start + pad}-{entry.offset})"
    if entry.offset - gap.start < pad + BLOCK:
        return Finding(part, f"a header block before byte {entry.offset}", "none: the members overlap")
    if len(data) != entry.offset - gap.start:
        return Finding(part, f"{entry.offset - gap.start} bytes", f"{len(data)}: the file ends")
    if data[:pad].count(0) != pad:
        where = f"the padding after member {gap.previous} (bytes {gap.start}-{gap.start + pad})"
        return Finding(where, "zeros", "other bytes")
    headers = data[pad:]
    problem = _header_problem(headers, entry)
    if problem is not None:
        return Finding(part, f"a tar header of the regular file {entry.name} of {entry.size} bytes", problem)
    if entry.header_checksum is not None and digest(headers) != entry.header_checksum:
        return Finding(
            part,
            f"the header blocks written (xxh3 {entry.header_checksum})",
            f"other bytes (xxh3 {digest(headers)})",
        )
    return None


def end_finding(start: int, data: bytes) -> Finding | None:
    """What is wrong with the end of the archive (``data``: from ``start``, the end of the last
    member's data, to the end of the file)."""
    pad = -start % BLOCK
    part = f"the end of the archive (bytes {start}-{start + len(data)}, after the last member's data)"
    if len(data) < pad + 2 * BLOCK or (len(data) - pad) % BLOCK:
        return Finding(part, "two or more zero blocks", f"{len(data) - pad} bytes")
    if data.count(0) != len(data):
        first = next(i for i, b in enumerate(data) if b)
        return Finding(part, "zeros", f"other bytes from byte {start + first}")
    return None


def _header_problem(headers: bytes, entry: IndexEntry) -> str | None:
    """Why the header blocks ``headers`` are not those of one regular file ``entry``; None if they are."""
    pax: dict[str, str] = {}
    long_name: str | None = None
    pos = 0
    while pos < len(headers):
        block = headers[pos : pos + BLOCK]
        at = f"block {pos // BLOCK}"
        if block == _ZERO_BLOCK:
            return f"a zero block ({at}): the end of the archive, to tar"
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            if str(exc) == "bad checksum":
                return f"a header block whose tar checksum (chksum) does not match its bytes ({at})"
            return f"a header block that does not parse: {exc} ({at})"
        pos += BLOCK
        if info.type in (*_PAX, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME):
            size = info.size
            body = headers[pos : pos + size]
            rest = headers[pos + size : pos + size + -size % BLOCK]
            pos += size + -size % BLOCK
            if pos > len(headers):
                return f"an extended header ({at}) of {size} bytes that runs into the member's data"
            if rest.count(0) != len(rest):
                return f"an extended header ({at}) whose padding is not zeros"
            if info.type == tarfile.GNUTYPE_LONGNAME:
                long_name = body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                continue
            records = _pax_records(body)
            if isinstance(records, str):
                return f"an extended header ({at}) that cannot be read: {records}"
            if info.type == tarfile.XGLTYPE:
                if {"path", "size"} & set(records):
                    return f"a global extended header ({at}) that sets a path or a size"
                continue
            pax.update(records)
            continue
        if pos != len(headers):
            return f"more header blocks than one member's ({(len(headers) - pos) // BLOCK} after {at})"
        if info.type not in _REGULAR or any(k.startswith("GNU.sparse") for k in pax):
            return f"a member of type {info.type!r}, not a regular file ({at})"
        name = pax.get("path", long_name if long_name is not None else info.name)
        if name != entry.name:
            return f"the name {name!r} ({at})"
        size_text = pax.get("size")
        if size_text is not None and not size_text.isdigit():
            return f"the size {size_text!r} in its extended header"
        size = int(size_text) if size_text is not None else info.size
        if size != entry.size:
            return f"a size of {size} bytes ({at})"
        return None
    return "no header of a regular file"


def _pax_records(body: bytes) -> dict[str, str] | str:
    """The records ``"%d key=value\\n"`` of a PAX extended header, or why they cannot be read."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(body):
        space = body.find(b" ", pos, pos + 20)
        digits = body[pos:space] if space > pos else b""
        if not digits.isdigit():
            return f"no record length at byte {pos}"
        length = int(digits)
        record = body[pos : pos + length]
        key, equals, value = record[len(digits) + 1 : -1].partition(b"=")
        if length <= len(digits) + 2 or len(record) != length or not record.endswith(b"\n") or not equals:
            return f"a malformed record at byte {pos}"
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


# -- reading the structure --------------------------------------------------------------------------


def check_tarball(aloc: Location, index: TarIndex) -> dict[str, str]:
    """Check the whole structure of ``aloc/index.tar`` against ``index``: its size, every member's
    header blocks and padding, the end. Returns each member's header checksum (xxh3), by name."""
    _check_size(aloc, index)
    every = gaps(index)
    end = end_start(index)
    data = _read(aloc, index, [(g.start, g.entry.offset) for g in every] + [(end, index.size)])
    for gap, chunk in zip(every, data, strict=False):
        _check_gap(aloc, index, gap, chunk)
    finding = end_finding(end, data[-1])
    if finding is not None:
        _fail(aloc, index, finding)
    return {g.entry.name: digest(header_blocks(g, chunk)) for g, chunk in zip(every, data, strict=False)}


def check_members(aloc: Location, index: TarIndex, prefix: str) -> None:
    """Check the size of the tarball and the header blocks of the members under ``prefix`` (e.g.
    ``"v000007/"``): what loading or extracting that version relies on besides its data."""
    _check_size(aloc, index)
    chosen = [  # from the block after the previous member's data: its padding is not this version's
        replace(g, start=g.start + -g.start % BLOCK) for g in gaps(index) if g.entry.name.startswith(prefix)
    ]
    data = _read(aloc, index, [(g.start, g.entry.offset) for g in chosen])
    for gap, chunk in zip(chosen, data, strict=True):
        _check_gap(aloc, index, gap, chunk)


def header_blocks(gap: Gap, data: bytes) -> bytes:
    """The header blocks in the bytes of ``gap``: what follows the previous member's padding."""
    return data[-gap.start % BLOCK :]


def _check_size(aloc: Location, index: TarIndex) -> None:
    size = stored_size(aloc, index.tar)
    if size != index.size:
        found = "no file" if size is None else f"{size} bytes"
        _fail(aloc, index, Finding("its size", f"{index.size} bytes", found))


def _check_gap(aloc: Location, index: TarIndex, gap: Gap, data: bytes) -> None:
    finding = gap_finding(gap, data)
    if finding is not None:
        _fail(aloc, index, finding)


def _read(aloc: Location, index: TarIndex, spans: list[tuple[int, int]]) -> list[bytes]:
    """The bytes of each (start, end) span of the tarball (which has the index's size); a span the
    index gets backwards comes back empty."""
    path = aloc.path(index.tar)
    wanted = [(start, max(start, end)) for start, end in spans]
    if not aloc.is_local:  # one batch of range requests, concurrent on object stores
        found = aloc.fs.cat_ranges([path] * len(wanted), [s for s, _ in wanted], [e for _, e in wanted])
        for chunk in found:
            if isinstance(chunk, Exception):
                raise chunk
        return list(found)
    fd = open_regular(path, aloc.fs)
    try:
        return [_pread(fd, start, end) for start, end in wanted]
    finally:
        os.close(fd)


def _pread(fd: int, start: int, end: int) -> bytes:
    """Bytes ``start``..``end`` of a local file, fewer where it ends first."""
    parts, pos = [], start
    while pos < end:
        chunk = os.pread(fd, end - pos, pos)
        if not chunk:
            break
        parts.append(chunk)
        pos += len(chunk)
    return b"".join(parts)


def _fail(aloc: Location, index: TarIndex, finding: Finding) -> NoReturn:
    versions = index.versions()
    runs = len(versions) > 2 and versions == list(range(versions[0], versions[-1] + 1))
    span = f"{versions[0]}-{versions[-1]}" if runs else ", ".join(map(str, versions))
    raise CorruptArchiveError(
        aloc.display(index.tar),
        part=finding.part,
        expected=finding.expected,
        actual=finding.actual,
        advice=(
            "it is not the tar that was archived, and tar or extraction may not read it: restore it from "
            "the mirror (--upload-to) or another copy, or, while the store still holds the loose copies "
            f"of versions {span}, remove the tarball and its index and archive them again"
        ),
    )
