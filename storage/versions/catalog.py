"""Where each committed version lives: its own directory, a tarball, or both.

The store asks the catalog, never the file system directly, which versions
exist and where their shards are read from. A version is committed when its
directory holds a valid manifest (*loose*) or a committed tarball's index
lists it (*archived*); when both hold it (between archiving and removing the
loose files) the loose copy is used. Listing reads every manifest; finding
the newest or the next free number reads as little as it can.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..archive.tarballs import ArchivedVersion, archive_location, archived_sources, list_archived
from ..archive.tarcheck import check_members, check_tarball
from ..archive.tarindex import index_name
from ..errors import CheckpointError, VersionNotFoundError
from ..files.location import Location
from ..files.sources import ShardSource, loose_sources
from ..format.manifest import Manifest
from ..format.names import version_dir
from . import commit as protocol


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
        return loose_sources(loc, self.manifest)

    def check_tarball(self, loc: Location, *, whole: bool) -> None:
        """An archived version: check its tarball's tar structure, all of it (``whole``: what verify
        checks) or the headers of this version's members (what a load checks). Loose: nothing."""
        if self.archived is None:
            return
        aloc = archive_location(loc)
        if whole:
            check_tarball(aloc, self.archived.index)
        else:
            check_members(aloc, self.archived.index, f"{version_dir(self.version)}/")

    def url(self, loc: Location) -> str:
        if self.archived is not None:
            return f"{archive_location(loc).display(self.archived.tar)}[{version_dir(self.version)}]"
        return loc.display(version_dir(self.version))


class References:
    """Which files of version directories committed loose versions reference: the marks that
    removal keeps (:mod:`.housekeeping`), and what makes a directory without a manifest no leftover."""

    def __init__(
        self, records: dict[int, protocol.VersionRecord], without: frozenset[int] = frozenset()
    ) -> None:
        """``records``: every version directory's (:func:`.commit.scan`); ``without``: versions whose
        manifests do not count (a dry run of their removal)."""
        self.files: dict[int, set[str]] = {}
        self.unknown = False  # a loose manifest could not be read: what it references is unknown
        for v, record in records.items():
            if v in without:
                continue
            if record.manifest is None:
                self.unknown = self.unknown or (record.error is not None and record.is_unreadable())
                continue
            for shard in record.manifest.shards:
                if shard.version is not None:
                    self.files.setdefault(shard.version, set()).add(shard.file)

    def keep(self, version: int) -> frozenset[str]:
        """The files of ``version``'s directory that must stay when it is removed."""
        return frozenset(self.files.get(version, ()))


def references(loc: Location, without: frozenset[int] = frozenset()) -> References:
    """The marks as the store holds them now (reads every loose manifest)."""
    return References(protocol.scan(loc), without)


@dataclass(frozen=True)
class Survey:
    """Every version of a store by state: what ``ls`` and ``verify --all`` report."""

    committed: dict[int, Located] = field(default_factory=dict)  # loose or archived
    unreadable: dict[int, CheckpointError] = field(default_factory=dict)  # loose, no readable copy
    writing: list[int] = field(default_factory=list)  # directories without a manifest
    set_aside: list[str] = field(default_factory=list)  # directories moved aside as unreadable
    bad_archives: dict[str, CheckpointError] = field(default_factory=dict)  # tarball -> why its index fails

    def newest(self) -> int | None:
        """The highest version number that is committed or unreadable."""
        return max([*self.committed, *self.unreadable], default=None)


def survey(loc: Location) -> Survey:
    """The state of every version, loose and archived (reads every manifest and index)."""
    bad: dict[str, CheckpointError] = {}
    records, found = scan(loc, bad)
    unreadable = {
        v: r.error for v, r in records.items() if r.error is not None and r.is_unreadable() and v not in found
    }
    marks = References(records)
    return Survey(
        committed=found,
        unreadable=unreadable,
        writing=[
            v
            for v, r in records.items()
            if r.is_writing()
            and v not in found
            # a removed version's directory that keeps only files others reference is no leftover
            and not (v in marks.files and set(protocol.list_files(loc, v)) <= marks.files[v])
        ],
        set_aside=protocol.list_set_aside(loc),
        bad_archives=bad,
    )


def committed(loc: Location) -> list[Located]:
    """Every committed version, oldest first."""
    return list(scan(loc)[1].values())


def scan(
    loc: Location, bad: dict[str, CheckpointError] | None = None
) -> tuple[dict[int, protocol.VersionRecord], dict[int, Located]]:
    """Every version directory's record, and the committed versions by number (the loose copy
    wins over an archived one); ``bad`` collects the tarballs whose index cannot be read."""
    records = protocol.scan(loc)
    found = {v: Located(a.manifest, a) for v, a in list_archived(loc, unreadable=bad).items()}
    found.update({v: Located(r.manifest) for v, r in records.items() if r.manifest is not None})
    return records, dict(sorted(found.items()))


def newest(loc: Location) -> Located | None:
    """The highest committed version (reads the top manifests and the tarball indexes)."""
    return newest_and_above(loc)[0]


def newest_and_above(loc: Location) -> tuple[Located | None, dict[int, protocol.VersionRecord]]:
    """The highest committed version, and the unreadable versions above it (loose, with no archived copy)."""
    archived = list_archived(loc)
    skipped: dict[int, protocol.VersionRecord] = {}
    record = protocol.newest_committed(loc, skipped=skipped)
    top_archived = max(archived, default=-1)
    found: Located | None = None
    if record is not None and record.manifest is not None and record.version >= top_archived:
        found = Located(record.manifest)
    elif archived:
        found = Located(archived[top_archived].manifest, archived[top_archived])
    top = found.version if found is not None else -1
    return found, {v: r for v, r in skipped.items() if v > top and v not in archived}


def find(loc: Location, version: int) -> Located:
    """One committed version; raises its manifest's error, or VersionNotFoundError listing the committed."""
    found = lookup(loc, version)
    if found is not None:
        return found
    record = protocol.read_record(loc, version)
    if record is not None and record.error is not None:
        raise record.error
    bad: dict[str, CheckpointError] = {}
    listed = list_archived(loc, unreadable=bad)
    loose = [v for v, r in protocol.scan(loc).items() if r.manifest is not None]
    error = VersionNotFoundError(version, loc.display(), sorted({*loose, *listed}))
    if bad:
        names = ", ".join(archive_location(loc).display(index_name(t)) for t in sorted(bad))
        error.args = (
            f"{error} and the index of {names} cannot be read, so the versions in it are not listed; "
            "`ckptflow archive URL --reindex` rebuilds an index from its tarball",
        )
    raise error


def lookup(loc: Location, version: int) -> Located | None:
    """One committed version, or None (a cheap test: it lists nothing but the archive indexes)."""
    record = protocol.read_record(loc, version)
    if record is not None and record.manifest is not None:
        return Located(record.manifest)
    archived = list_archived(loc).get(version)
    return Located(archived.manifest, archived) if archived is not None else None


def next_version(loc: Location, *, at_least: int = 0) -> int:
    """Above every version directory (committed or not) and every archived version, and >= ``at_least``."""
    return max(max([*protocol.version_numbers(loc), *archived_for_writing(loc)], default=-1) + 1, at_least)


def archived_for_writing(loc: Location) -> dict[int, ArchivedVersion]:
    """The archived versions, for a writer choosing a number: refused while an index cannot be read.

    The versions of such a tarball are unknown, so a new version could take one of their numbers
    (and a later ``--reindex`` would bring two versions of one number back).
    """
    bad: dict[str, CheckpointError] = {}
    found = list_archived(loc, unreadable=bad)
    if bad:
        names = ", ".join(archive_location(loc).display(index_name(t)) for t in sorted(bad))
        raise CheckpointError(
            f"not writing to {loc.display()}: the index {names} cannot be read, so the versions in its "
            "tarball are unknown and a new version could reuse one of their numbers. Rebuild it first: "
            "`ckptflow archive URL --reindex` (or move the tarball out of archive/)"
        )
    return found
