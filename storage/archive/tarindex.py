"""The index of a tarball: where each member's bytes are, and the tarball's commit.

``epochs-000000-000009.tar`` is described by ``epochs-000000-000009.index.json``
next to it: the tar's size and xxh3, and for every member its name, the offset
of its data in the tar, its size and xxh3 and the xxh3 of its header blocks
(format 3; :mod:`.tarcheck` checks an older index's headers by parsing them),
plus ``extra`` (free-form; the archiver puts the archived versions' manifests
there, so listing an archive reads one small file).

What must always hold: the index is the tarball's commit, as the manifest is a
version's. It is written (atomically: temp, fsync, rename, directory fsync on
local disks; one PUT on object stores) only after the tar is durable, and only
if the tar has the size it records. A tar without an index that parses and
validates is garbage, never read. An index is untrusted input when it is read:
member names must be safe relative paths, listed once, and every member must
lie inside the tar, so a corrupt or forged index cannot send a reader outside
the tar or an extraction outside its directory.
"""

from __future__ import annotations

import enum
import json
import logging
import tarfile
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import (
    ArchiveNotCommittedError,
    CorruptShardError,
    FormatVersionError,
    ManifestError,
    UnsafeArchiveError,
)
from ..files.atomic import write_file_atomic
from ..files.location import Location
from ..format.checksum import ALGORITHM
from ..format.manifest import (
    MANIFEST_FILE,
    Manifest,
    check_seal,
    check_sealed_bytes,
    load_versioned_json,
    seal,
    sealed_json,
    validate_manifest,
    validation_problems,
)
from ..format.manifest_checks import MAX_BYTES
from ..format.names import parse_version_dir, relative_name_problem

log = logging.getLogger(__name__)

INDEX_FORMAT = "ckptflow-archive-index"
# 2 added ``index_checksum``, 3 each member's ``header_checksum``, 4 compact JSON sealed over
# its keys in document order (the archived manifests' structures keep their key order)
INDEX_FORMAT_VERSION = 4
SEALED_INDEX_VERSION = 2
HEADER_CHECKSUM_VERSION = 3
ORDERED_INDEX_VERSION = 4
INDEX_SEAL_KEY = "index_checksum"
INDEX_SUFFIX = ".index.json"
BLOCK = tarfile.BLOCKSIZE  # 512: tar headers and data are laid out in blocks


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IndexEntry(_Model):
    name: str
    offset: int = Field(ge=BLOCK)  # first byte of the member's data in the tar (after its header)
    size: int = Field(ge=0)
    checksum: str
    # xxh3 of its header blocks (from the block after the previous member's data to ``offset``);
    # None in an index older than format 3, whose headers are checked by parsing alone
    header_checksum: str | None = None


class TarIndex(_Model):
    format: str = INDEX_FORMAT
    format_version: int = INDEX_FORMAT_VERSION
    tar: str  # file name of the tarball, next to this index
    size: int = Field(ge=0)
    checksum: str  # xxh3_64 of every byte of the tar
    checksum_algorithm: str = ALGORITHM
    created: str
    members: list[IndexEntry]
    extra: dict[str, Any] = Field(default_factory=dict)  # free-form: e.g. the archived manifests

    def entry(self, name: str) -> IndexEntry:
        for e in self.members:
            if e.name == name:
                return e
        raise ManifestError(f"archive index of {self.tar} has no member {name!r}")

    def manifests(self, where: str) -> dict[int, Manifest]:
        """The archived manifests (``extra.manifests``), each fully checked and keyed by its own
        version; ManifestError naming the index for anything else."""
        raw = self.extra.get("manifests", {})
        if not isinstance(raw, dict):
            raise ManifestError(f"archive index {where}: extra.manifests is not an object")
        found: dict[int, Manifest] = {}
        for key, value in raw.items():
            manifest = validate_manifest(value, f"{where}[{key}]")
            if key != str(manifest.version):
                raise ManifestError(
                    f"archive index {where}: the manifest under {key!r} is version {manifest.version}"
                )
            found[manifest.version] = manifest
        return found

    def under(self, prefix: str) -> list[IndexEntry]:
        """Members whose name starts with ``prefix`` (e.g. ``"v000007/"``), in tar order."""
        return [e for e in self.members if e.name.startswith(prefix)]

    def versions(self) -> list[int]:
        """Versions archived in this tarball: top-level directories named ``v%06d`` with a manifest
        member (a directory of only shards holds bytes its versions reference)."""
        found = {
            parse_version_dir(e.name.split("/", 1)[0])
            for e in self.members
            if e.name.endswith(f"/{MANIFEST_FILE}")
        }
        return sorted(v for v in found if v is not None)

    def to_json(self) -> bytes:
        """The index as written, sealed with its own checksum (the archived manifests included)."""
        raw = self.model_dump(mode="json")
        for member in raw["members"]:  # an older index stays in its own format
            if member["header_checksum"] is None:
                del member["header_checksum"]
        has_headers = any("header_checksum" in m for m in raw["members"])
        raw["format_version"] = max(
            self.format_version, SEALED_INDEX_VERSION, HEADER_CHECKSUM_VERSION if has_headers else 0
        )
        if raw["format_version"] < ORDERED_INDEX_VERSION:  # its seal as older ckptflow computes it
            return json.dumps(seal(raw, INDEX_SEAL_KEY, ordered=False), allow_nan=False).encode()
        return sealed_json(raw, INDEX_SEAL_KEY)


def index_name(tar_name: str) -> str:
    """``epochs-000000-000009.tar`` -> ``epochs-000000-000009.index.json``."""
    return tar_name.removesuffix(".tar") + INDEX_SUFFIX


def check_member_name(name: str, where: str = "") -> str:
    """``name`` if it is a relative path of plain names (:mod:`.names`); else UnsafeArchiveError."""
    reason = relative_name_problem(name)
    if reason:
        raise UnsafeArchiveError(f"{where + ': ' if where else ''}member name {name!r} {reason}; refused")
    return name


def parse_index(data: bytes, where: str) -> TarIndex:
    """Parse and validate an index: format, version, safe unique names, offsets inside the tar."""
    raw = load_versioned_json(
        data, where, kind="archive index", name=INDEX_FORMAT, version=INDEX_FORMAT_VERSION, verb="read"
    )
    ordered = raw["format_version"] >= ORDERED_INDEX_VERSION
    body = check_sealed_bytes(data, raw, INDEX_SEAL_KEY) if ordered else None
    if body is None:
        required = raw["format_version"] >= SEALED_INDEX_VERSION
        body = check_seal(
            raw, INDEX_SEAL_KEY, where, kind="archive index", required=required, ordered=ordered
        )
    raw = body
    try:
        index = TarIndex.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(f"archive index {where} is invalid: {validation_problems(exc)}") from None
    _check_layout(index, where)
    return index


def _check_layout(index: TarIndex, where: str) -> None:
    if index.checksum_algorithm != ALGORITHM:
        raise ManifestError(
            f"archive index {where} uses checksum {index.checksum_algorithm!r}, not {ALGORITHM}"
        )
    seen: set[str] = set()
    for e in index.members:
        check_member_name(e.name, where)
        if e.name in seen:
            raise UnsafeArchiveError(f"{where}: member {e.name!r} is listed twice; refused")
        seen.add(e.name)
        if e.offset % BLOCK or e.offset + e.size > index.size:
            raise ManifestError(
                f"archive index {where}: member {e.name!r} at offset {e.offset} ({e.size} bytes) "
                f"is not a block inside the {index.size}-byte tar"
            )


def stored_size(loc: Location, name: str) -> int | None:
    """The size of ``loc/name`` as stored now (not from a listing cache); None if it is not there."""
    path = loc.path(name)
    loc.fs.invalidate_cache(path)
    try:
        found: int | None = loc.fs.size(path)
        return found
    except FileNotFoundError:
        return None


def write_index(dst: Location, index: TarIndex) -> None:
    """Commit ``dst/index.tar``: check the tar is there whole, then write its index atomically."""
    size = stored_size(dst, index.tar)
    if size != index.size:
        found = "no file" if size is None else f"{size} bytes"
        raise CorruptShardError(
            dst.display(index.tar), expected=f"{index.size} bytes", actual=found, what="size"
        )
    write_file_atomic(dst, index_name(index.tar), index.to_json())


def read_index(loc: Location, tar_name: str) -> TarIndex:
    """The index of the tarball ``loc/tar_name``; ArchiveNotCommittedError when it has none."""
    name = index_name(tar_name)
    try:
        data = loc.fs.cat_file(loc.path(name), start=0, end=MAX_BYTES + 1)
    except FileNotFoundError:
        raise ArchiveNotCommittedError(
            f"tarball {loc.display(tar_name)} has no index {name}: it was never committed (archiving "
            "crashed or is still running); do not read it: remove it and archive its versions again"
        ) from None
    index = parse_index(data, loc.display(name))
    if index.tar != tar_name:
        raise ManifestError(f"archive index {loc.display(name)} describes {index.tar!r}, not {tar_name!r}")
    return index


class ArchiveState(enum.Enum):
    PARTIAL = "partial"  # a tar without an index: being written, or left by a crash; garbage
    COMMITTED = "committed"  # the index validates and the tar has the size it records
    UNREADABLE = "unreadable"  # an index that is corrupt or newer, or whose tar is missing or resized


def archive_state(loc: Location, tar_name: str) -> ArchiveState | None:
    """The state of one tarball, read from storage (None: neither the tar nor its index exists)."""
    try:
        index = read_index(loc, tar_name)
    except ArchiveNotCommittedError:
        return ArchiveState.PARTIAL if loc.fs.exists(loc.path(tar_name)) else None
    except (ManifestError, FormatVersionError, UnsafeArchiveError) as exc:
        log.warning("tarball %s: %s", loc.display(tar_name), exc)
        return ArchiveState.UNREADABLE
    try:
        size = loc.fs.size(loc.path(tar_name))
    except FileNotFoundError:
        size = None
    return ArchiveState.COMMITTED if size == index.size else ArchiveState.UNREADABLE
