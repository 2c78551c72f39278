"""Where each committed version lives: its own directory, a tarball, or both.

The store asks the catalog, never the file system directly, which versions
exist and where their shards are read from. A version is committed when its
directory holds a valid manifest (*loose*) or a committed tarball's index
lists it (*archived*); when both hold it (between archiving and removing the
loose files) the loose copy is used. Listing reads every manifest; finding
the newest or the next free number reads as little as it can.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import commit as protocol
from .archiving import ArchivedVersion, archive_location, archived_sources, list_archived
from .commit import version_dir
from .errors import VersionNotFoundError
from .location import Location
from .manifest import Manifest
from .reader import ShardSource, loose_sources


@dataclass(frozen=True)
class Located:
    """A committed version and where it is read from."""

    manifest: Manifest
    archived: ArchivedVersion | None = None  # None: loose (its own directory)

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def is_archived(self) -> bool:
        return self.archived is not None

    def sources(self, loc: Location) -> list[ShardSource]:
        if self.archived is not None:
            return archived_sources(loc, self.archived)
        return loose_sources(loc, version_dir(self.version), self.manifest)

    def url(self, loc: Location) -> str:
        if self.archived is not None:
            return f"{archive_location(loc).display(self.archived.tar)}[{version_dir(self.version)}]"
        return loc.display(version_dir(self.version))


def committed(loc: Location) -> list[Located]:
    """Every committed version, oldest first."""
    loose = {v: r.manifest for v, r in protocol.scan(loc).items() if r.manifest is not None}
    found = {v: Located(a.manifest, a) for v, a in list_archived(loc).items()}
    found.update({v: Located(m) for v, m in loose.items()})
    return [found[v] for v in sorted(found)]


def newest(loc: Location) -> Located | None:
    """The highest committed version (reads the top manifests and the tarball indexes)."""
    archived = list_archived(loc)
    record = protocol.newest_committed(loc)
    top_archived = max(archived, default=-1)
    if record is not None and record.manifest is not None and record.version >= top_archived:
        return Located(record.manifest)
    return Located(archived[top_archived].manifest, archived[top_archived]) if archived else None


def find(loc: Location, version: int) -> Located:
    """One committed version; raises its manifest's error, or VersionNotFoundError listing the committed."""
    found = lookup(loc, version)
    if found is not None:
        return found
    record = protocol.read_record(loc, version)
    if record is not None and record.error is not None:
        raise record.error
    raise VersionNotFoundError(version, loc.display(), [x.version for x in committed(loc)])


def lookup(loc: Location, version: int) -> Located | None:
    """One committed version, or None (a cheap test: it lists nothing but the archive indexes)."""
    record = protocol.read_record(loc, version)
    if record is not None and record.manifest is not None:
        return Located(record.manifest)
    archived = list_archived(loc).get(version)
    return Located(archived.manifest, archived) if archived is not None else None


def next_version(loc: Location) -> int:
    """Above every version directory (committed or not) and every archived version."""
    return max([*protocol.list_dirs(loc), *list_archived(loc)], default=-1) + 1
