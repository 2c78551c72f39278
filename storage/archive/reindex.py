"""Rebuild a tarball's index from the tarball itself.

The index is the tarball's commit; when it is damaged (it exists but cannot be
read), the versions in the tarball are unreadable, although every byte they
need is still there (a tarball with no index at all is an interrupted archive
job's leftover, which ``gc`` removes): the
tar holds each version's shards *and* its ``manifest.json``. This module walks
the tar's headers (never extracting anything), checks every member as
extraction would (a plain relative name inside ``v%06d/``, a regular file),
hashes each member, parses and checks every archived manifest, and checks each
shard member against its manifest's size and checksum, then the tar's structure
as ``verify`` does (:mod:`.tarcheck`, which also gives each member's header
checksum). Only a tarball whose every version passes gets a new index; the damaged index is kept beside it
under a name nothing reads (``<name>.index.json.unreadable-<time>-<hex>``), copied
there before the new index replaces it in one atomic write.
"""

from __future__ import annotations

import logging
import tarfile

from ..errors import CheckpointError, CorruptArchiveError, ManifestError, UnsafeArchiveError
from ..files.byteio import hash_range
from ..files.location import Location
from ..format.checksum import digest, new_hasher
from ..format.manifest import MANIFEST_FILE, Manifest, parse_manifest, utc_now
from ..format.manifest_checks import MAX_BYTES
from ..format.names import aside_name, is_plain_name, parse_version_dir
from .tarcheck import check_tarball
from .tarindex import IndexEntry, TarIndex, check_member_name, index_name, write_index

log = logging.getLogger(__name__)


def rebuild_index(aloc: Location, tar: str) -> TarIndex:
    """Write a new index for ``aloc/tar`` from its members; return it. Raises if any member is unsafe or
    any archived version does not match its manifest (then nothing is written)."""
    where = aloc.display(tar)
    entries, manifests = _scan(aloc, tar, where)
    for _version, manifest in manifests.items():
        for shard, (vdir, file) in zip(manifest.shards, manifest.shard_files(), strict=True):
            entry = entries.get(f"{vdir}/{file}")
            if entry is None or entry.size != shard.size or entry.checksum != shard.checksum:
                raise CheckpointError(
                    f"cannot rebuild the index of {where}: member {vdir}/{file} is missing or does not "
                    "match its manifest; the tarball is damaged: restore it from a copy"
                )
    size = aloc.fs.size(aloc.path(tar))
    index = TarIndex(
        tar=tar,
        size=size,
        checksum=hash_range(aloc.fs, aloc.path(tar), 0, size, local=aloc.is_local),
        created=utc_now(),
        members=list(entries.values()),
        extra={"manifests": {str(v): m.model_dump(mode="json") for v, m in sorted(manifests.items())}},
    )
    try:  # tarfile stops quietly at a damaged header mid-tar, as if the archive ended there
        headers = check_tarball(aloc, index)
    except CorruptArchiveError as exc:
        raise CheckpointError(
            f"cannot rebuild the index of {where}: {exc.part}: expected {exc.expected}, found {exc.actual}; "
            "the tarball is damaged: restore it from a copy"
        ) from None
    index = index.model_copy(
        update={"members": [e.model_copy(update={"header_checksum": headers[e.name]}) for e in index.members]}
    )
    _keep_damaged(aloc, tar)
    write_index(aloc, index)
    log.info("rebuilt the index of %s: versions %s", where, sorted(manifests))
    return index


def _scan(aloc: Location, tar: str, where: str) -> tuple[dict[str, IndexEntry], dict[int, Manifest]]:
    entries: dict[str, IndexEntry] = {}
    manifests: dict[int, Manifest] = {}
    try:
        with aloc.fs.open(aloc.path(tar), "rb") as raw, tarfile.open(fileobj=raw, mode="r:") as archive:
            for info in archive:
                name = check_member_name(info.name, where)
                if not info.isreg():
                    raise UnsafeArchiveError(f"{where}: member {name!r} is not a regular file; refused")
                parts = name.split("/")
                if len(parts) != 2 or parse_version_dir(parts[0]) is None or not is_plain_name(parts[1]):
                    raise UnsafeArchiveError(f"{where}: member {name!r} is not v<version>/<file>; refused")
                if name in entries:
                    raise UnsafeArchiveError(f"{where}: member {name!r} appears twice; refused")
                if parts[1] == MANIFEST_FILE:
                    if info.size > MAX_BYTES:  # refused before it is read
                        raise ManifestError(f"{where}: member {name} is {info.size} bytes, not a manifest")
                    data = archive.extractfile(info).read()  # type: ignore[union-attr]
                    manifest = parse_manifest(data, f"{where}[{name}]")
                    if manifest.version != parse_version_dir(parts[0]):
                        raise CheckpointError(f"{where}[{name}] says version {manifest.version}")
                    manifests[manifest.version] = manifest
                    checksum = digest(data)
                else:
                    checksum = _member_checksum(aloc, tar, info)
                entries[name] = IndexEntry(
                    name=name, offset=info.offset_data, size=info.size, checksum=checksum
                )
    except tarfile.TarError as exc:
        raise CheckpointError(f"cannot rebuild the index of {where}: not a readable tar ({exc})") from None
    if not manifests:
        raise CheckpointError(f"cannot rebuild the index of {where}: it holds no version manifest")
    return entries, manifests


def _member_checksum(aloc: Location, tar: str, info: tarfile.TarInfo) -> str:
    if not info.size:
        return new_hasher().hexdigest()
    return hash_range(aloc.fs, aloc.path(tar), info.offset_data, info.size, local=aloc.is_local)


def _keep_damaged(aloc: Location, tar: str) -> None:
    """Copy a damaged index aside (a name nothing lists or removes); the new one then replaces it
    atomically, so the tarball is never without an index (``gc`` removes tarballs without one)."""
    name = index_name(tar)
    if not aloc.fs.exists(aloc.path(name)):
        return
    aside = aside_name(name)
    aloc.fs.copy(aloc.path(name), aloc.path(aside))
    log.warning("kept the damaged index of %s as %s", aloc.display(tar), aside)
