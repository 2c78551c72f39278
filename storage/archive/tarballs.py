"""Archived versions: committed versions consolidated into tarballs under ``archive/``.

An object store holds a few big files better than thousands of small ones, so
committed versions are moved into ``archive/epochs-000001-000010.tar`` (plain
PAX tar: members ``v000007/shard-r0-00.h5`` and ``v000007/manifest.json``)
with an index beside it (member -> offset, size, checksum, plus the archived
manifests). A version is then *archived*: it is listed and loaded from the
tarball by range reads through the index, without extracting anything.

The order that keeps every committed version loadable at every instant: the
tar is written and durable, then its index (the tarball's commit), then (when
an upload is configured) the upload is verified, and only then are the loose
files removed, manifest first. Between the index and the removal a version
exists twice; loading prefers the loose copy. An archive that fails removes
what it wrote (the tarball, and its index if that was written after all), as a
failed save does: its versions are still loose. It never removes a tarball that
was there before it started, nor an index another writer committed. A tar without an index is
garbage from a crash and ``gc`` removes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..errors import CheckpointError, FormatVersionError, ManifestError, UnsafeArchiveError
from ..files.location import Location
from ..files.sources import ShardSource
from ..format.checksum import digest
from ..format.manifest import MANIFEST_FILE, Manifest
from ..format.manifest_checks import MAX_BYTES
from ..format.names import ARCHIVE_DIR, version_dir
from .tarindex import INDEX_SUFFIX, TarIndex, index_name, parse_index, write_index
from .tarwriter import Member, write_tar

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArchivedVersion:
    """A version that lives in a committed tarball."""

    manifest: Manifest
    tar: str
    index: TarIndex


def archive_location(loc: Location) -> Location:
    """The ``archive/`` directory of a store, as a Location of its own."""
    return Location(f"{loc.url.rstrip('/')}/{ARCHIVE_DIR}", loc.fs, loc.path(ARCHIVE_DIR))


def tar_name(manifests: list[Manifest]) -> str:
    """``epochs-000001-000010.tar``: named by the first and last epoch (or version) it holds."""
    numbers = [m.epoch if m.epoch is not None else m.version for m in manifests]
    return f"epochs-{min(numbers):06d}-{max(numbers):06d}.tar"


def list_tarballs(loc: Location) -> tuple[list[str], list[str]]:
    """(committed tar names, tar names without an index) under ``archive/``."""
    aloc = archive_location(loc)
    if not aloc.fs.exists(aloc.root):
        return [], []
    names = [p.rsplit("/", 1)[-1] for p in aloc.fs.ls(aloc.root, detail=False)]
    indexed = {n.removesuffix(INDEX_SUFFIX) + ".tar" for n in names if n.endswith(INDEX_SUFFIX)}
    tars = {n for n in names if n.endswith(".tar")}
    return sorted(indexed), sorted(tars - indexed)


def list_archived(
    loc: Location, *, unreadable: dict[str, CheckpointError] | None = None
) -> dict[int, ArchivedVersion]:
    """Every version found in a committed tarball, by version number (newest tarball wins).

    ``unreadable`` collects the tarballs whose index cannot be read (by tar name), whose
    versions are then not listed.
    """
    aloc = archive_location(loc)
    committed, _ = list_tarballs(loc)
    paths = [aloc.path(index_name(t)) for t in committed]
    raw = aloc.fs.cat(paths, on_error="return", start=0, end=MAX_BYTES + 1) if paths else {}
    found: dict[int, ArchivedVersion] = {}
    for tar, path in zip(committed, paths, strict=True):
        data = raw.get(path)
        if isinstance(data, ManifestError):  # e.g. not a regular file inside the store
            log.warning("ignoring tarball %s: %s", aloc.display(tar), data)
            if unreadable is not None:
                unreadable[tar] = data
            continue
        if not isinstance(data, bytes):
            continue
        try:
            index = parse_index(data, aloc.display(index_name(tar)))
            manifests = list(index.manifests(aloc.display(index_name(tar))).values())
            for m in manifests:
                _check_members(index, m, aloc.display(index_name(tar)))
        except (ManifestError, FormatVersionError, UnsafeArchiveError, ValueError) as exc:
            log.warning("ignoring tarball %s: %s", aloc.display(tar), exc)
            if unreadable is not None:
                unreadable[tar] = exc if isinstance(exc, CheckpointError) else ManifestError(str(exc))
            continue
        for m in manifests:
            found[m.version] = ArchivedVersion(m, tar, index)
    return found


def _check_members(index: TarIndex, manifest: Manifest, where: str) -> None:
    """Every file of an archived version is a member of its tarball, of the size its manifest says."""
    sizes = {e.name: e.size for e in index.members}
    for shard, (vdir, file) in zip(manifest.shards, manifest.shard_files(), strict=True):
        name = f"{vdir}/{file}"
        if sizes.get(name) != shard.size:
            found = "no such member" if name not in sizes else f"a member of {sizes[name]} bytes"
            raise ManifestError(
                f"archive index {where}: version {manifest.version}'s shard {name} ({shard.size} bytes) "
                f"is {found} in the tarball"
            )


def archive_versions(loc: Location, manifests: list[Manifest], *, name: str | None = None) -> TarIndex:
    """Write the tarball of committed ``manifests`` and its index; the loose files stay."""
    if not manifests:
        raise ValueError("nothing to archive: no versions given")
    ordered = sorted(manifests, key=lambda m: m.version)
    members: list[Member] = []
    taken: set[str] = set()  # a file several versions reference is one member
    for m in ordered:
        vdir = version_dir(m.version)
        for s, (where, file) in zip(m.shards, m.shard_files(), strict=True):
            if f"{where}/{file}" not in taken:  # the files of other versions it references too
                taken.add(f"{where}/{file}")
                members.append(Member(f"{where}/{file}", loc.path(where, file), s.size, s.checksum))
        data = loc.fs.cat_file(loc.path(vdir, MANIFEST_FILE))
        members.append(
            Member(f"{vdir}/{MANIFEST_FILE}", loc.path(vdir, MANIFEST_FILE), len(data), digest(data))
        )
    aloc = archive_location(loc)
    extra = {"manifests": {str(m.version): m.model_dump(mode="json") for m in ordered}}
    tar = name or tar_name(ordered)
    tar_existed = aloc.fs.exists(aloc.path(tar))  # e.g. a crash's leftover: not ours to remove
    index = write_tar(loc, members, aloc, tar, extra=extra)
    try:
        write_index(aloc, index)
    except BaseException:
        _discard(aloc, index, tar_existed=tar_existed)
        raise
    log.info("archived versions %s into %s", [m.version for m in ordered], aloc.display(index.tar))
    return index


def archived_sources(loc: Location, archived: ArchivedVersion) -> list[ShardSource]:
    """The shards of an archived version, as byte ranges of its tarball."""
    aloc = archive_location(loc)
    sources = []
    for shard, (vdir, file) in zip(archived.manifest.shards, archived.manifest.shard_files(), strict=True):
        entry = archived.index.entry(f"{vdir}/{file}")
        if entry.size != shard.size or entry.checksum != shard.checksum:
            raise CheckpointError(
                f"{aloc.display(archived.tar)}: member {entry.name} disagrees with its manifest"
            )
        name = f"{aloc.display(archived.tar)}[{entry.name}]"
        sources.append(ShardSource(aloc.path(archived.tar), entry.offset, archived.index.size, name))
    return sources


def _discard(aloc: Location, index: TarIndex, *, tar_existed: bool) -> None:
    """Remove what an archive call whose index failed (a full disk) wrote: its index, if written
    after all, then its tarball unless that was there before the call. An index with other bytes
    is another writer's commit: then nothing is removed. Its versions are still loose."""
    tar, name = aloc.path(index.tar), aloc.path(index_name(index.tar))
    try:
        aloc.fs.invalidate_cache(name)
        try:
            found: bytes | None = aloc.fs.cat_file(name)
        except FileNotFoundError:
            found = None
        if found is not None and found != index.to_json():
            return  # another writer committed this tarball: its files, not this call's
        if found is not None:
            aloc.remove_file(name)
        if not tar_existed and aloc.fs.exists(tar):
            aloc.remove_file(tar)
    except Exception as exc:  # garbage either way (gc removes it); keep the first error
        log.warning("could not remove the uncommitted tarball %s: %s", aloc.display(index.tar), exc)


def remove_tarball(loc: Location, tar: str) -> None:
    """Delete a tarball, its index first (a crash midway leaves a partial tar: garbage)."""
    aloc = archive_location(loc)
    for name in (index_name(tar), tar):
        if aloc.fs.exists(aloc.path(name)):
            aloc.remove_file(aloc.path(name))
