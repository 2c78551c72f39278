"""The commit protocol and the states of a version.

A version is a directory ``v%06d`` under the store's root. Its state is read
from storage, never remembered:

- ``WRITING``: the directory exists but has no manifest. Either a save is in
  progress or one crashed; such a version is never loaded and ``gc`` removes
  it (only one writer per store at a time is supported; ``gc(min_age=...)``
  spares directories that changed recently).
- ``COMMITTED``: ``manifest.json`` exists and validates. This is the only state
  readers trust.
- ``UNREADABLE``: a manifest exists but is corrupt, or was written by a newer
  ckptflow. Never loaded, never garbage-collected: a person must look at it.
  A writer that resumes past a corrupt one *sets it aside*: the directory is
  renamed ``v000008.unreadable-20261124T154000Z-3f9a1c``, a name that is no version
  (so the number is free again), that ``ls`` shows and ``gc`` never touches.

The protocol: every shard is fully written (fsynced on local disks) before the manifest is written,
and is found with its size by one listing just before (a shard removed mid-save fails the commit);
on local disks the manifest goes to a temporary name, is fsynced and hard-linked into place, and the
directory is fsynced; on object stores one PUT is atomic. Either way the manifest is created only if
absent (a link never replaces a name; the PUT carries ``If-None-Match: *``), so no commit replaces
another writer's. A PUT can be stored while its answer is lost: a writer that is told the manifest
exists, or whose PUT failed, reads it back, and a manifest holding its own bytes is its commit.
Before its first shard, a writer claims the version number with a claim file created the same
exclusive way; the commit checks the claim is still its own and removes it. The ``latest`` pointer
is updated after the commit and is only a hint for other tools: the truth is "the highest committed
version", and a ``latest`` that could not be written fails no save.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass

from ..errors import CheckpointError, FormatVersionError, ManifestError, VersionTakenError
from ..files.atomic import exclusive_local_write, exclusive_remote_write, write_file_atomic
from ..files.byteio import fsync_dir
from ..files.location import Location, bucket_missing, missing_bucket_error
from ..format.manifest import MANIFEST_FILE, Manifest, ManifestDraft, ShardEntry, parse_manifest
from ..format.manifest_checks import MAX_BYTES
from ..format.names import LATEST_FILE, aside_name, is_set_aside_dir, parse_version_dir, version_dir
from .claims import check_claim, drop_claim

log = logging.getLogger(__name__)


class VersionState(enum.Enum):
    WRITING = "writing"
    COMMITTED = "committed"
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class VersionRecord:
    version: int
    state: VersionState
    manifest: Manifest | None = None
    error: CheckpointError | None = None  # why an UNREADABLE version cannot be read

    def is_committed(self) -> bool:
        return self.state is VersionState.COMMITTED

    def is_writing(self) -> bool:
        return self.state is VersionState.WRITING

    def is_unreadable(self) -> bool:
        return self.state is VersionState.UNREADABLE


def list_dirs(loc: Location) -> dict[int, bool]:
    """Every version directory under the root: version -> whether it has a manifest file.

    One listing, no file read: enough to find the versions or the garbage.
    """
    if not _root_exists(loc):
        return {}
    if loc.is_local:  # one scandir and a stat per version; fsspec's walk stats every file of every version
        dirs = {}
        with os.scandir(loc.root) as entries:
            for entry in entries:
                version = parse_version_dir(entry.name)
                if version is not None:
                    dirs[version] = _has_manifest(entry)
        return dict(sorted(dirs.items()))
    entries = loc.fs.find(loc.root, maxdepth=2, withdirs=True, detail=False)
    found: dict[int, bool] = {}
    for path in entries:
        rel = path[len(loc.root) :].strip("/").split("/")
        version = parse_version_dir(rel[0])
        if version is None:
            continue
        found[version] = found.get(version, False) or (len(rel) == 2 and rel[1] == MANIFEST_FILE)
    return dict(sorted(found.items()))


def _has_manifest(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir() and os.path.lexists(os.path.join(entry.path, MANIFEST_FILE))
    except OSError:  # a symlink loop, say: no version that can be read (reading it says why)
        return False


def version_numbers(loc: Location) -> list[int]:
    """The number of every version directory, committed or not: what numbering a new version needs.
    One listing of the root (on an object store, of its prefixes), not of the versions' files, so
    that a save costs the same in a store of ten versions or of ten thousand."""
    if not _root_exists(loc):
        return []
    names = os.listdir(loc.root) if loc.is_local else loc.fs.ls(loc.root, detail=False)
    return sorted(v for name in names if (v := parse_version_dir(name)) is not None)


def _root_exists(loc: Location) -> bool:
    loc.fs.invalidate_cache()  # listings cached by fsspec (s3fs) miss changes made by other processes
    if loc.fs.exists(loc.root):
        return True
    if bucket_missing(loc):  # else a mistyped bucket would look like an empty store
        raise missing_bucket_error(loc)
    return False


def newest_committed(
    loc: Location, *, skipped: dict[int, VersionRecord] | None = None
) -> VersionRecord | None:
    """The highest committed version, reading manifests from the top down until one validates.

    ``skipped`` collects the unreadable versions passed on the way down.
    """
    for version, has_manifest in sorted(list_dirs(loc).items(), reverse=True):
        if has_manifest:
            record = read_record(loc, version)
            if record is not None and record.is_committed():
                return record
            if record is not None and record.is_unreadable() and skipped is not None:
                skipped[version] = record
    return None


def scan(loc: Location) -> dict[int, VersionRecord]:
    """The state of every version directory under the root, by version number (reads every manifest)."""
    dirs = list_dirs(loc)
    with_manifest = [v for v, has in dirs.items() if has]
    paths = [loc.path(version_dir(v), MANIFEST_FILE) for v in with_manifest]
    # at most one byte past the limit: a huge (or sparse) manifest is refused, not read whole
    raw = loc.fs.cat(paths, on_error="return", start=0, end=MAX_BYTES + 1) if paths else {}
    records = {v: VersionRecord(v, VersionState.WRITING) for v, has in dirs.items() if not has}
    for v in with_manifest:
        data = raw[loc.path(version_dir(v), MANIFEST_FILE)]
        records[v] = _record(loc, v, data)
    return dict(sorted(records.items()))


def _record(loc: Location, version: int, data: bytes | Exception) -> VersionRecord:
    if isinstance(data, FileNotFoundError):  # vanished between listing and reading
        return VersionRecord(version, VersionState.WRITING)
    if isinstance(data, ManifestError):  # e.g. not a regular file inside the store
        log.warning("ignoring version %d: %s", version, data)
        return VersionRecord(version, VersionState.UNREADABLE, error=data)
    if isinstance(data, Exception):
        raise data
    try:
        manifest = parse_manifest(data, loc.display(version_dir(version), MANIFEST_FILE))
    except (ManifestError, FormatVersionError) as exc:
        log.warning("ignoring version %d: %s", version, exc)
        return VersionRecord(version, VersionState.UNREADABLE, error=exc)
    if manifest.version != version:
        error = ManifestError(f"manifest of {version_dir(version)} says version {manifest.version}")
        log.warning("ignoring version %d: %s", version, error)
        return VersionRecord(version, VersionState.UNREADABLE, error=error)
    return VersionRecord(version, VersionState.COMMITTED, manifest)


def read_record(loc: Location, version: int) -> VersionRecord | None:
    """The state of one version, reading only its manifest (None: no such directory)."""
    path = loc.path(version_dir(version), MANIFEST_FILE)
    try:
        data: bytes | Exception = loc.fs.cat_file(path, start=0, end=MAX_BYTES + 1)
    except (FileNotFoundError, ManifestError) as exc:
        data = exc
    record = _record(loc, version, data)
    if record.is_writing() and not loc.fs.exists(loc.path(version_dir(version))):
        return None
    return record


def commit(loc: Location, manifest: Manifest | ManifestDraft, *, claim: str | None = None) -> None:
    """Write the manifest of a version whose shards are all durable: the version now exists.

    The manifest is created only if absent, so a commit never replaces another writer's.
    ``claim``: the token this writer claimed the version with; it must still be the claim's.
    """
    vdir = version_dir(manifest.version)
    if claim is not None:
        check_claim(loc, manifest.version, claim)
    check_shards_present(loc, manifest)
    create_manifest(loc, manifest)
    # Committed. What follows only tidies up: a failure is logged, never raised (the save succeeded).
    if claim is not None:
        try:
            drop_claim(loc, manifest.version)
        except Exception as exc:  # ``gc`` removes the claim of a committed version
            log.warning("committed %s, but could not remove its claim: %s", loc.display(vdir), exc)
    if _is_newest(loc, manifest.version):  # a save with an explicit, lower version leaves latest alone
        _write_latest(loc, vdir)


def create_manifest(loc: Location, manifest: Manifest | ManifestDraft) -> None:
    """Create ``manifest.json`` of a version if it does not exist yet; raise VersionTakenError if it does.

    On an object store a PUT can be stored while its answer is lost (a reset, a 500, a timeout): the
    client's retry then finds the manifest, or every attempt fails. Either way, the manifest stored
    is read back, and if it holds this writer's bytes the commit is this writer's and stands.
    """
    vdir = version_dir(manifest.version)
    path = loc.path(vdir, MANIFEST_FILE)
    data = manifest.to_json()
    try:
        if loc.is_local:
            exclusive_local_write(loc.path(vdir), MANIFEST_FILE, data)
        else:
            exclusive_remote_write(loc.fs, path, data)
        return
    except FileExistsError:
        if _stored(loc, path) == data:
            return  # our own PUT, retried by the client after a lost answer
    except Exception:
        if loc.is_local or not _stored_anyway(loc, path, data):
            raise
        log.info("committed %s: its manifest was stored though no answer said so", loc.display(vdir))
        return
    raise VersionTakenError(
        f"not committing {loc.display(vdir)}: another writer committed version {manifest.version} while "
        "this one was writing it; that commit stands. Only one writer may use a store at a time"
    )


def _stored(loc: Location, path: str) -> bytes | None:
    """The manifest at ``path`` as stored now (None: none), past fsspec's caches: s3fs would answer
    from its listing of the version directory, taken before the manifest was written."""
    loc.fs.invalidate_cache(path)
    try:
        return bytes(loc.fs.cat_file(path, start=0, end=MAX_BYTES + 1))
    except FileNotFoundError:
        return None


def _stored_anyway(loc: Location, path: str, data: bytes) -> bool:
    """After a failed PUT of the manifest ``data``: whether it was stored all the same."""
    try:
        return _stored(loc, path) == data
    except Exception as exc:  # the store still fails: the PUT's own error says more
        log.debug("could not read back %s: %s", path, exc)
        return False


def check_shards_present(loc: Location, manifest: Manifest | ManifestDraft) -> None:
    """Refuse to commit a version whose shard files are not all there, each under the name that is
    its identity (:func:`..format.names.file_identity`) and with its size.

    One listing of each directory its shards are in: its own, and those of the versions whose
    bytes it references. It catches a shard removed while the save ran (``gc`` or ``prune`` from
    another process, a lifecycle rule, a directory removed by hand), which would otherwise become
    a committed version that cannot be loaded.
    """
    shards = [
        s if s.version is not None else s.model_copy(update={"version": manifest.version})
        for s in manifest.shards
    ]
    there = present_shards(loc, shards)
    wrong = [
        s.file if s.version is None else f"{s.directory(manifest.version)}/{s.file}"
        for i, s in enumerate(manifest.shards)
        if i not in there
    ]
    if wrong:
        vdir = version_dir(manifest.version)
        raise CheckpointError(
            f"not committing {loc.display(vdir)}: shard files {', '.join(wrong)} are missing or changed "
            "since the save began (was `ckptflow gc` or `prune` run on a store being saved to, or a "
            "version directory removed by hand?). The previous version stays the latest; the next save "
            "writes those bytes again"
        )


def present_shards(loc: Location, shards: list[ShardEntry]) -> set[int]:
    """Which of ``shards`` (each naming its version) are there now, with their sizes: one listing
    (past fsspec's caches) of each version directory they are in."""
    listed: dict[int, dict[str, object]] = {}
    there = set()
    for i, shard in enumerate(shards):
        assert shard.version is not None
        if shard.version not in listed:
            path = loc.path(version_dir(shard.version))
            loc.fs.invalidate_cache(path)
            try:
                listed[shard.version] = {
                    e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size")
                    for e in loc.fs.ls(path, detail=True)
                }
            except FileNotFoundError:
                listed[shard.version] = {}
        if listed[shard.version].get(shard.file) == shard.size:
            there.add(i)
    return there


def _is_newest(loc: Location, version: int) -> bool:
    """Whether no committed version above ``version`` exists (one listing in the usual case)."""
    try:
        loc.fs.invalidate_cache(loc.root)
        names = loc.fs.ls(loc.root, detail=False)
        higher = [v for name in names if (v := parse_version_dir(name)) is not None and v > version]
        return not any(loc.fs.exists(loc.path(version_dir(v), MANIFEST_FILE)) for v in higher)
    except Exception as exc:  # the commit stands; update the pointer as if this were the newest
        log.warning("could not list %s: %s", loc.display(), exc)
        return True


def _write_latest(loc: Location, vdir: str) -> None:
    try:
        # No fsync: a hint readers never trust need not survive a crash of the machine (two of a
        # small save's seven fsyncs).
        write_file_atomic(loc, LATEST_FILE, f"{vdir}\n".encode(), durable=False)
    except Exception as exc:  # the commit stands; the pointer is only a hint, which readers never trust
        log.warning(
            "could not update %s (to %s): %s; it is only a hint, readers find the newest committed "
            "version without it",
            loc.display(LATEST_FILE),
            vdir,
            exc,
        )


def refresh_latest(loc: Location, committed: list[int]) -> None:
    """Point ``latest`` at the newest committed version, or remove it when there is none."""
    if committed:
        _write_latest(loc, version_dir(max(committed)))
    elif loc.fs.exists(loc.path(LATEST_FILE)):
        loc.fs.rm_file(loc.path(LATEST_FILE))


def remove_version(loc: Location, version: int, *, keep: frozenset[str] = frozenset()) -> None:
    """Delete a version directory, manifest first, so a crash midway leaves garbage, not a broken
    version. ``keep``: its files whose bytes committed versions reference; they stay, and so does
    the directory, until no committed version references them (gc removes them then)."""
    vdir = loc.path(version_dir(version))
    remove_manifest(loc, version)
    files = list_files(loc, version) if keep else []
    if not any(name in keep for name in files):
        if loc.fs.exists(vdir):
            loc.remove_tree(vdir)
        return
    for name in files:
        if name not in keep:
            loc.remove_file(loc.path(version_dir(version), name))


def remove_manifest(loc: Location, version: int) -> None:
    """Make a version stop existing: remove its manifest (durably on a local disk)."""
    manifest = loc.path(version_dir(version), MANIFEST_FILE)
    if loc.fs.exists(manifest):
        loc.fs.rm_file(manifest)
        if loc.is_local:
            fsync_dir(loc.path(version_dir(version)))


def list_files(loc: Location, version: int) -> list[str]:
    """The names of the files in a version's directory (none if it is gone)."""
    path = loc.path(version_dir(version))
    loc.fs.invalidate_cache(path)
    try:
        return sorted(
            e["name"].rstrip("/").rsplit("/", 1)[-1]
            for e in loc.fs.ls(path, detail=True)
            if e["type"] == "file"
        )
    except FileNotFoundError:
        return []


def set_aside(loc: Location, version: int, *, keep: frozenset[str] = frozenset()) -> str:
    """Rename an unreadable version's directory to a name that is no version; return that name.

    ``keep``: files of it that committed versions reference. They stay where those versions read
    them; the rest (its manifest first) moves into the new directory, and the version's directory,
    now without a manifest, is what removing a version leaves (``gc`` removes it once unreferenced).
    """
    name = aside_name(version_dir(version))
    source, target = loc.path(version_dir(version)), loc.path(name)
    if not keep and loc.is_local:
        os.rename(source, target)  # atomic: the version is there under one name or the other
        fsync_dir(loc.root)
        return name
    # An object store has no directories to rename: each file moves, as listed now (past the
    # caches: a listing taken before a prune names files that are gone)
    moving = sorted(list_files(loc, version), key=lambda f: f != MANIFEST_FILE)  # the manifest first
    if loc.is_local:
        os.makedirs(target)
        for file in moving:
            if file not in keep:
                os.rename(os.path.join(source, file), os.path.join(target, file))
        fsync_dir(target)
        fsync_dir(source)
        fsync_dir(loc.root)
    else:
        for file in moving:
            if file not in keep:
                loc.fs.mv(f"{source}/{file}", f"{target}/{file}")
    return name


def list_set_aside(loc: Location) -> list[str]:
    """Names of the directories that writers set aside as unreadable (see :func:`set_aside`)."""
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in loc.fs.ls(loc.root, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(n for n in names if is_set_aside_dir(n))


def clear_leftovers(loc: Location, version: int) -> None:
    """Remove what a crashed save of ``version`` left behind, before writing it again."""
    record = read_record(loc, version)
    if record is None:
        return
    if not record.is_writing():
        raise CheckpointError(f"refusing to clear {version_dir(version)}: it is {record.state.value}")
    loc.remove_tree(loc.path(version_dir(version)))
