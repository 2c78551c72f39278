"""Removing things safely: delete, prune, drop archived loose copies, collect garbage.

Every removal keeps the rule that a committed version is loadable until it is
deliberately deleted: a version directory loses its manifest first (a crash
midway leaves garbage, never a broken version); a tarball loses its index
first; loose files of an archived version go only once its tarball is
committed; a tarball goes only when none of its versions is kept (members
cannot be cut out of a tar). ``gc`` removes what crashes leave: version
directories without a manifest, tarballs without an index, temp files.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

from ..archive.tarballs import (
    archive_location,
    archive_versions,
    list_archived,
    list_tarballs,
    remove_tarball,
)
from ..archive.tarindex import TarIndex
from ..errors import CheckpointError, VersionNotFoundError
from ..files.atomic import stale_temp_files
from ..files.location import Location
from ..format.names import version_dir
from . import catalog, claims
from . import commit as protocol
from .retention import PrunePlan, RetentionPolicy, plan_prune

log = logging.getLogger(__name__)


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
        protocol.remove_version(loc, version)
    protocol.refresh_latest(loc, [v for v in numbers if v != version])


def plan(loc: Location, policy: RetentionPolicy) -> PrunePlan:
    """What pruning by ``policy`` would do now (reads only)."""
    found = catalog.committed(loc)
    tarball_of = {v: a.tar for v, a in list_archived(loc).items()}
    return plan_prune(
        [x.manifest for x in found], policy, tarball_of=tarball_of, loose=protocol.list_dirs(loc)
    )


def prune(loc: Location, policy: RetentionPolicy) -> PrunePlan:
    """Delete what :func:`plan` says; return the plan carried out.

    A version the policy drops stays (held) while its tarball holds a version
    the policy keeps; its loose copy, if any, goes.
    """
    carried = plan(loc, policy)
    for tar in carried.tarballs:
        remove_tarball(loc, tar)
    for version in carried.loose:
        protocol.remove_version(loc, version)
    protocol.refresh_latest(loc, list(carried.remaining))
    return carried


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
    removed = []
    for v in versions:
        if v not in archived:
            raise CheckpointError(
                f"version {v} is not in a committed tarball: its loose files are its only copy"
            )
        if v in loose:
            protocol.remove_version(loc, v)
            removed.append(v)
    return removed


def collect_garbage(loc: Location, *, min_age: float = 0.0) -> list[int]:
    """Remove version directories without a manifest, tarballs without an index and temp files.

    ``min_age`` (seconds): leave alone what changed more recently, since a save or
    an archive job in another process may still be writing it.
    """
    garbage = garbage_versions(loc, min_age)
    for v in garbage:
        loc.remove_tree(loc.path(version_dir(v)))
    _, partial = list_tarballs(loc)
    aloc = archive_location(loc)
    for tar in partial:
        if settled(loc, aloc.path(tar), min_age):
            log.info("removing %s: a tarball without an index (archiving was interrupted)", tar)
            remove_tarball(loc, tar)
    for v in claims.stray_claims(loc):  # a writer killed between its commit and removing its claim
        claims.drop_claim(loc, v)
    for path in stale_temp_files(loc):
        if settled(loc, path, min_age):
            os.remove(path)
    return garbage


def garbage_versions(loc: Location, min_age: float = 0.0) -> list[int]:
    """Version directories without a manifest that ``gc(min_age=...)`` removes (one listing)."""
    return [
        v
        for v, has_manifest in protocol.list_dirs(loc).items()
        if not has_manifest and settled(loc, loc.path(version_dir(v)), min_age)
    ]


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
