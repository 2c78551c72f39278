"""Removing things safely: delete, prune, drop archived loose copies, collect garbage.

Every removal keeps the rule that a committed version is loadable until it is
deliberately deleted: a version directory loses its manifest first (a crash
midway leaves garbage, never a broken version); a tarball loses its index
first; loose files of an archived version go only once its tarball is
committed; a tarball goes only when none of its versions is kept (members
cannot be cut out of a tar). ``gc`` removes what crashes leave: version
directories without a manifest, tarballs without an index, temp files of
atomic writes (in the root and in ``archive/``), and says which it removed and
which it spared as too recent (:class:`GarbageReport`). A version a live writer
has claimed (:mod:`.claims`) is a save in flight, never garbage, whatever the
age limit: a save without the writer lease (the library's plain ``save``) is
safe from a ``gc`` beside it.

Versions share bytes (format 8): a version's manifest may reference shard
files in an older version's directory instead of writing the same bytes
again. Removal is then mark and sweep: the files that committed loose
versions reference (:class:`.catalog.References`) are never removed, whatever removes;
a deleted or pruned version loses its manifest and its other files, and its
directory keeps the referenced ones until no committed version needs them,
when ``gc`` (or the next prune) removes them. The marks are read from the
committed manifests at the time of the removal, so a crash at any instant
loses nothing a committed version references. On a local disk the marks and
the sweep hold the store's fence (:func:`.lease.fence`), under which every
commit checks that its files are there and creates its manifest: a save that
references a file commits either before the marks (and marks it) or after
the sweep (and finds it gone, and fails). On object stores there is no such
fence: a save whose file a removal in another process sweeps between the save's
check and its manifest's PUT would commit without it, so removals there must
not run beside another process's saves (the lease keeps other writers out).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import time
from typing import TypeVar

from ..archive.tarballs import (
    archive_location,
    archive_versions,
    list_archived,
    list_tarballs,
    remove_tarball,
)
from ..archive.tarindex import TarIndex, index_name
from ..errors import CheckpointError, VersionNotFoundError
from ..files.atomic import stale_temp_files
from ..files.location import Location
from ..format.names import version_dir
from . import catalog, claims
from . import commit as protocol
from .catalog import References
from .lease import fence
from .retention import PrunePlan, RetentionPolicy, plan_prune

log = logging.getLogger(__name__)

T = TypeVar("T")


def remove_versions(loc: Location, versions: list[int]) -> dict[int, int]:
    """Remove loose versions but the files others reference; return the bytes freed of each. Every
    manifest goes first, then the marks are read from the manifests that stay, then the sweep: a
    crash at any point leaves garbage, never a committed version without its bytes."""
    sizes = {v: _file_sizes(loc, v) for v in versions}  # the manifests' bytes count as freed too
    for version in versions:
        protocol.remove_manifest(loc, version)
    with fence(loc):  # no commit between the marks and the sweep (a commit checks its files under it)
        return sweep(loc, versions, catalog.references(loc), sizes)


def sweep(
    loc: Location, versions: list[int], refs: References, sizes: dict[int, dict[str, int]] | None = None
) -> dict[int, int]:
    """Remove the files of the (manifest-less) directories of ``versions`` that no committed
    version references, and each directory left empty; return the bytes freed in each (``sizes``:
    of the files as they were before their manifests went)."""
    if refs.unknown and versions:
        log.warning(
            "a version's manifest cannot be read, so the bytes it references are unknown: removed "
            "versions keep their shard files until it is readable or set aside (then run gc)"
        )
    freed = {}
    for version in versions:
        found = _file_sizes(loc, version)
        keep = _kept(refs, version, list(found))
        before = {**found, **(sizes or {}).get(version, {})}
        freed[version] = sum(size for name, size in before.items() if name not in keep)
        protocol.remove_version(loc, version, keep=keep)
    return freed


def freed_by_removing(loc: Location, versions: list[int], refs: References | None = None) -> dict[int, int]:
    """The bytes :func:`remove_versions` would free now in each version (reads only): its files but
    those the other committed versions reference (``refs``, without ``versions``: read now if not given)."""
    refs = refs if refs is not None else catalog.references(loc, frozenset(versions))
    freed = {}
    for version in versions:
        found = _file_sizes(loc, version)
        keep = _kept(refs, version, list(found))
        freed[version] = sum(size for name, size in found.items() if name not in keep)
    return freed


def _kept(refs: References, version: int, files: list[str]) -> frozenset[str]:
    keep = refs.keep(version)
    if refs.unknown:
        keep = keep | {f for f in files if f.endswith(".h5")}
    return frozenset(keep)


def _file_sizes(loc: Location, version: int) -> dict[str, int]:
    return {
        name: _size(loc, loc.path(version_dir(version), name)) for name in protocol.list_files(loc, version)
    }


def _size(loc: Location, path: str) -> int:
    try:
        return int(loc.fs.size(path) or 0)
    except FileNotFoundError:
        return 0


def delete_version(loc: Location, version: int) -> None:
    """Delete one committed version; an archived one only if it is alone in its tarball."""
    found = catalog.committed(loc)
    numbers = [x.version for x in found]
    if version not in numbers:
        raise VersionNotFoundError(version, loc.display(), numbers)
    archived = list_archived(loc).get(version)
    if archived is not None:
        others = sorted(v for v in archived.index.extra.get("manifests", {}) if int(v) != version)
        if others:
            raise CheckpointError(
                f"version {version} lives in {archive_location(loc).display(archived.tar)} with versions "
                f"{', '.join(others)}; a tarball is removed whole: prune them together"
            )
        remove_tarball(loc, archived.tar)
    if version in protocol.list_dirs(loc):
        remove_versions(loc, [version])
    protocol.refresh_latest(loc, [v for v in numbers if v != version])


def plan(loc: Location, policy: RetentionPolicy) -> PrunePlan:
    """What pruning by ``policy`` would do now (reads only)."""
    records, committed = catalog.scan(loc)
    found = list(committed.values())
    tarball_of = {v: a.tar for v, a in list_archived(loc).items()}
    planned = plan_prune(
        [x.manifest for x in found], policy, tarball_of=tarball_of, loose=protocol.list_dirs(loc)
    )
    aloc = archive_location(loc)
    tars = sum(
        _size(loc, aloc.path(tar)) + _size(loc, aloc.path(index_name(tar))) for tar in planned.tarballs
    )
    gone = frozenset(planned.loose)
    loose = freed_by_removing(loc, list(gone), References(records, gone)) if gone else {}
    return dataclasses.replace(planned, freed=tars + sum(loose.values()), freed_each=loose)


def prune(loc: Location, policy: RetentionPolicy) -> PrunePlan:
    """Delete what :func:`plan` says; return the plan carried out.

    A version the policy drops stays (held) while its tarball holds a version
    the policy keeps; its loose copy, if any, goes.
    """
    carried = plan(loc, policy)
    freed = 0
    for tar in carried.tarballs:
        aloc = archive_location(loc)
        freed += _size(loc, aloc.path(tar)) + _size(loc, aloc.path(index_name(tar)))
        remove_tarball(loc, tar)
    each = remove_versions(loc, list(carried.loose))
    protocol.refresh_latest(loc, list(carried.remaining))
    return dataclasses.replace(carried, freed=freed + sum(each.values()), freed_each=each)


def archive(loc: Location, versions: list[int], *, name: str | None = None) -> TarIndex:
    """Consolidate loose committed ``versions`` into one tarball (the loose copies stay)."""
    manifests = []
    for v in versions:
        located = catalog.find(loc, v)
        if located.is_archived:
            raise CheckpointError(f"version {v} is already archived in {located.url(loc)}")
        manifests.append(located.manifest)
    return archive_versions(loc, manifests, name=name)


def drop_loose(loc: Location, versions: list[int]) -> list[int]:
    """Remove the loose copies of versions that a committed tarball holds; return those removed."""
    archived = list_archived(loc)
    loose = protocol.list_dirs(loc)
    for v in versions:
        if v not in archived:
            raise CheckpointError(
                f"version {v} is not in a committed tarball: its loose files are its only copy"
            )
    removed = [v for v in versions if v in loose]
    remove_versions(loc, removed)
    return removed


@dataclasses.dataclass(frozen=True)
class Leftovers:
    """What interrupted saves and archive jobs left behind."""

    versions: tuple[int, ...] = ()  # version directories without a manifest
    tarballs: tuple[str, ...] = ()  # tarballs without an index (names under ``archive/``)
    temp_files: tuple[str, ...] = ()  # temp files of atomic writes (paths under the root; local only)

    def __bool__(self) -> bool:
        return bool(self.versions or self.tarballs or self.temp_files)


@dataclasses.dataclass(frozen=True)
class GarbageReport:
    """What gc removed (in a dry run: would remove), and what it spared as changed too recently."""

    removed: Leftovers
    spared: Leftovers
    freed: int = 0  # bytes removed (0 in a dry run)
    writing: tuple[int, ...] = ()  # versions a live writer claims: saves in flight, never removed


def find_garbage(loc: Location, min_age: float = 0.0) -> GarbageReport:
    """Every leftover, split by ``min_age`` into those gc removes and those it spares (reads only)."""
    aloc = archive_location(loc)
    _, partial = list_tarballs(loc)
    temps = [os.path.relpath(p, loc.root) for p in (*stale_temp_files(loc), *stale_temp_files(aloc))]
    refs = catalog.references(loc)
    leftover = [v for v, ok in protocol.list_dirs(loc).items() if not ok and _holds_garbage(loc, v, refs)]
    writing = tuple(v for v in leftover if being_written(loc, v))  # spared whatever min_age says
    leftover = [v for v in leftover if v not in writing]
    versions = _by_age(loc, [(v, loc.path(version_dir(v))) for v in leftover], min_age)
    tarballs = _by_age(loc, [(tar, aloc.path(tar)) for tar in partial], min_age)
    temp_files = _by_age(loc, [(name, loc.path(name)) for name in temps], min_age)
    return GarbageReport(
        Leftovers(versions[0], tarballs[0], temp_files[0]),
        Leftovers(versions[1], tarballs[1], temp_files[1]),
        writing=writing,
    )


def _by_age(loc: Location, items: list[tuple[T, str]], min_age: float) -> tuple[tuple[T, ...], tuple[T, ...]]:
    """The items of (item, path) pairs unchanged for ``min_age`` seconds, and those changed since."""
    ages = [(item, settled(loc, path, min_age)) for item, path in items]
    return tuple(item for item, ok in ages if ok), tuple(item for item, ok in ages if not ok)


def collect_garbage(loc: Location, *, min_age: float = 0.0) -> GarbageReport:
    """Remove version directories without a manifest, tarballs without an index and temp files.

    ``min_age`` (seconds): leave alone what changed more recently, since a save or
    an archive job in another process may still be writing it.
    """
    report = find_garbage(loc, min_age)
    with fence(loc):
        freed = sum(sweep(loc, list(report.removed.versions), catalog.references(loc)).values())
    aloc = archive_location(loc)
    tarballs = []
    for tar in report.removed.tarballs:
        if aloc.fs.exists(aloc.path(index_name(tar))):
            continue  # committed since it was listed: no leftover
        log.info("removing %s: a tarball without an index (archiving was interrupted)", tar)
        freed += _size(loc, aloc.path(tar))
        aloc.remove_file(aloc.path(tar))
        tarballs.append(tar)
    for v in claims.stray_claims(loc):  # a writer killed between its commit and removing its claim
        claims.drop_claim(loc, v)
    for name in report.removed.temp_files:
        with contextlib.suppress(FileNotFoundError):
            os.remove(loc.path(name))
    return dataclasses.replace(
        report, removed=dataclasses.replace(report.removed, tarballs=tuple(tarballs)), freed=freed
    )


CLAIM_SECONDS = 180.0  # a claim whose writer's liveness is unknown (another host) and whose version
# changed for this long is a leftover (as for a writer: saving.STALE_CLAIM_SECONDS)


def being_written(loc: Location, version: int) -> bool:
    """Whether a live writer claims ``version`` (:mod:`.claims`): its process runs (on this host), or
    on another host, its version changed in the last CLAIM_SECONDS. A save without the writer lease
    (a library's plain ``store.save``) is then in flight, and ``gc`` leaves it alone."""
    found = claims.read_claim(loc, version)
    if found is None or found.writer_ended():
        return False
    if found.writer_runs():
        return True
    changed = last_change(loc, loc.path(version_dir(version)))
    return changed is None or time.time() - changed < CLAIM_SECONDS


def _holds_garbage(loc: Location, version: int, refs: References) -> bool:
    """Whether a directory without a manifest holds a file no committed version references (a
    pruned version's directory that keeps only referenced shards is not garbage)."""
    keep = refs.keep(version)
    if not keep:
        return True
    return any(name not in keep for name in protocol.list_files(loc, version))


def settled(loc: Location, path: str, min_age: float) -> bool:
    """Whether nothing at ``path`` changed in the last ``min_age`` seconds (unknown times are recent)."""
    if min_age <= 0:
        return True
    now = time.time()
    changed = last_change(loc, path)
    if changed is not None and now - changed >= min_age:
        return True
    ago = "at an unknown time" if changed is None else f"{now - changed:.0f}s ago"
    log.info("leaving %s: changed %s, less than %gs ago", loc.display(path), ago, min_age)
    return False


def last_change(loc: Location, path: str) -> float | None:
    """Newest modification time (epoch seconds) of a file or of anything under a directory."""
    try:
        entries = [loc.fs.info(path)]
        if entries[0].get("type") == "directory":
            entries += list(loc.fs.find(path, detail=True, withdirs=True).values())
    except FileNotFoundError:
        return None
    times = [t for e in entries if (t := _mtime(e)) is not None]
    return max(times) if times else None


def _mtime(entry: dict) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = entry.get(key)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return None
