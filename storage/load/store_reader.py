"""The read side of a store: list, find, load and verify committed versions.

:class:`StoreReader` answers every question a :class:`~ckptflow.storage.CheckpointStore`
is asked about what is committed, loose or archived, and reads states back. It only reads:
nothing here changes a store, so any number of processes may read while one writes. A
version is found (:meth:`StoreReader.locate`) before its bytes are read; every state but
committed is a clear error naming what the version is and what to do.

The good copy wins: a version can be held twice, loose and in a committed tarball (between
archiving and dropping the loose files, or kept so on purpose). Loading prefers the loose copy;
when that copy is missing a file or fails a checksum and the tarball's copy is the same version
(the same manifest), the load reads the tarball's, saying so once per version, and ``verify``
checks both copies and names the damaged one and the command that repairs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..archive.tarballs import list_archived
from ..collector import collector_paused
from ..errors import (
    CorruptShardError,
    ManifestError,
    UnreadableVersionError,
    VersionNotFoundError,
)
from ..files import nearby
from ..files.location import Location, translate_errors
from ..format.manifest import Manifest
from ..info import StoreOptions, VersionInfo
from ..versions import catalog
from ..versions import commit as protocol
from .restore import rank_manifest, read_state
from .verifying import verify_version

if TYPE_CHECKING:
    import torch

    from ..archive.tarballs import ArchivedVersion
    from ..save.group import RankGroup

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoreReader:
    """What a store reads: its catalog of versions and their states."""

    def __init__(self, loc: Location, options: StoreOptions, group: RankGroup) -> None:
        self.loc, self.options, self.group = loc, options, group
        self._told: set[int] = set()  # versions read from their tarball: said once

    def versions(self) -> list[VersionInfo]:
        """Committed versions, loose and archived, oldest first."""
        with translate_errors(self.loc, "listing"):
            return [self.info_of(x) for x in catalog.committed(self.loc)]

    def latest(self) -> VersionInfo | None:
        """The newest committed version (the one a resumed run starts from), or None."""
        with translate_errors(self.loc, "listing"):
            found = catalog.newest(self.loc)
        return self.info_of(found) if found else None

    def info(self, version: int | None = None) -> VersionInfo:
        """One committed version (the newest when ``version`` is None); raises if not committed."""
        return self.info_of(self.locate(version))

    def find(self, version: int) -> VersionInfo | None:
        """A committed version, or None if ``version`` is not committed (without listing the others)."""
        with translate_errors(self.loc, "reading"):
            found = catalog.lookup(self.loc, version)
        return self.info_of(found) if found is not None else None

    def find_step(self, step: int) -> VersionInfo | None:
        """The committed version saved at global step ``step`` (the newest, if several were), or None."""
        with translate_errors(self.loc, "listing"):
            found = [x for x in catalog.committed(self.loc) if x.manifest.step == step]
        return self.info_of(found[-1]) if found else None  # oldest first: the last is the newest

    def version_at(self, step: int) -> int:
        """The committed version saved at global step ``step`` (the newest, if several were);
        VersionNotFoundError names the committed steps just below and above it."""
        found = self.find_step(step)
        if found is not None:
            return found.version
        infos = self.versions()
        error = VersionNotFoundError(None, self.loc.display(), [i.version for i in infos])
        error.args = (step_missing_message(step, infos, self.loc.display()),)
        raise error

    def manifest(self, version: int | None = None) -> Manifest:
        """The manifest of a committed version (the newest when ``version`` is None)."""
        return self.locate(version).manifest

    def load(
        self,
        version: int | None = None,
        *,
        keys: Sequence[str] | None = None,
        map_location: str | torch.device = "cpu",
        verify: bool | None = None,
        into: Any = None,
    ) -> Any:
        """The state saved in ``version`` (default: the newest committed one)."""
        return self.load_located(
            self.locate(version), keys=keys, map_location=map_location, verify=verify, into=into
        )

    def load_located(
        self,
        located: catalog.Located,
        *,
        keys: Sequence[str] | None = None,
        map_location: str | torch.device = "cpu",
        verify: bool | None = None,
        into: Any = None,
    ) -> Any:
        """The state of a version already found by :meth:`locate`."""
        with collector_paused():
            return self._good_copy(
                located,
                lambda x: read_state(self.loc, self.options, x, x.manifest, keys, map_location, verify, into),
            )

    def load_rank_state(
        self,
        version: int | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        map_location: str | torch.device = "cpu",
        verify: bool | None = None,
    ) -> Any:
        """The ``rank_state`` rank ``rank`` saved (default: this store's rank), or None if none was saved."""
        located = self.locate(version)
        rank = self.group.rank if rank is None else rank
        world = self.group.world_size if world_size is None else world_size
        manifest = rank_manifest(located.manifest, rank, world, stacklevel=2)
        if manifest is None:
            return None
        opts = self.options
        return self._good_copy(
            located, lambda x: read_state(self.loc, opts, x, manifest, None, map_location, verify, None)
        )

    def _good_copy(self, located: catalog.Located, read: Callable[[catalog.Located], T]) -> T:
        """``read(located)``; when its loose copy is damaged, ``read`` of its tarball's copy."""
        try:
            return read(located)
        except CorruptShardError as exc:
            other = self.archived_copy(located)
            if other is None:
                raise
            if located.version not in self._told:
                self._told.add(located.version)
                log.warning(
                    "version %d: its loose copy is damaged (%s); reading its copy in %s instead (`ckptflow "
                    "verify` says how to repair the loose one)",
                    located.version,
                    exc,
                    other.url(self.loc),
                )
            return read(other)

    def archived_copy(self, located: catalog.Located) -> catalog.Located | None:
        """The copy in a committed tarball of a loose version, the same version (None: none)."""
        if located.is_archived:
            return None
        with translate_errors(self.loc, "reading"):
            archived = list_archived(self.loc).get(located.version)
        if archived is None or archived.manifest != located.manifest:
            return None
        return catalog.Located(archived.manifest, archived)

    def verify(self, version: int | None = None) -> VersionInfo:
        """Check every byte of a version (loose or archived) against its checksums, and its tar structure."""
        if version is None:
            with translate_errors(self.loc, "reading"):
                found, above = catalog.newest_and_above(self.loc)
            if above:
                top = max(above)
                error = above[top].error or ManifestError(f"manifest of version {top} cannot be read")
                raise UnreadableVersionError(top, self.loc.display(), error, found.version if found else None)
            if found is None:
                raise VersionNotFoundError(None, self.loc.display(), [])
            return self.verify_located(found)
        return self.verify_located(self.locate(version))

    def verify_located(self, located: catalog.Located) -> VersionInfo:
        """Check the shards of a version found by :meth:`survey` (no second look-up), and of its
        copy in a tarball if it has one: a damaged copy fails, naming which and how to repair it."""
        other = self.archived_copy(located)
        problems = {}
        for copy in (located, other) if other is not None else (located,):
            try:
                with translate_errors(self.loc, "verifying"):
                    copy.check_tarball(self.loc, whole=True)
                    verify_version(self.loc, copy.manifest, copy.sources(self.loc))
            except CorruptShardError as exc:
                problems[copy.is_archived] = exc
        if other is not None and problems:
            raise self._repair(located, other, problems)
        if problems:
            raise problems[located.is_archived]
        return self.info_of(located)

    def _repair(
        self, loose: catalog.Located, archived: catalog.Located, problems: dict[bool, CorruptShardError]
    ) -> CorruptShardError:
        """The error of a version held twice, loose and archived, one copy or both damaged: the
        damaged copy's own error, saying what the other copy is and how to repair."""
        v, url, tar = loose.version, self.loc.display(), archived.url(self.loc)
        if len(problems) == 2:
            error = problems[False]
            said = f"; its copy in {tar} is damaged too: {problems[True]}"
        elif False in problems:
            error = problems[False]
            said = (
                f" (version {v}'s loose copy). Its copy in {tar} is intact and loads in its place; "
                f"remove the damaged loose copy with `ckptflow archive {url} --versions {v} --drop-loose`"
            )
        else:
            error = problems[True]
            said = (
                f" (version {v}'s copy in {tar}). Its loose copy is intact and loads; archive it again "
                "into a new tarball once the damaged one is removed (a tarball is removed whole)"
            )
        error.args = (f"{error}{said}",)
        return error

    def survey(self) -> catalog.Survey:
        """Every version by state: committed (loose or archived), unreadable, being written, set aside."""
        with translate_errors(self.loc, "listing"):
            return catalog.survey(self.loc)

    def version_dirs(self) -> dict[int, bool]:
        """Every version directory, by number, and whether it holds a manifest file."""
        with translate_errors(self.loc, "listing"):
            return protocol.list_dirs(self.loc)

    def misplaced(self) -> nearby.VersionDirectory | nearby.StoresBelow | None:
        """What the URL is when it is a version's directory or holds stores; None for a store."""
        with translate_errors(self.loc, "listing"):
            return nearby.misplaced(self.loc)

    def archived(self) -> dict[int, ArchivedVersion]:
        """The versions in committed tarballs, by number, each with its tarball's name and index."""
        with translate_errors(self.loc, "listing"):
            return list_archived(self.loc)

    def info_of(self, located: catalog.Located) -> VersionInfo:
        """The listing entry of a version found by :meth:`survey`."""
        return VersionInfo.from_manifest(
            located.manifest, located.url(self.loc), archived=located.is_archived
        )

    def locate(self, version: int | None) -> catalog.Located:
        """A committed version and where it lives; raise a clear error for any other state."""
        with translate_errors(self.loc, "reading"):
            if version is None:
                found = catalog.newest(self.loc)
                if found is None:
                    raise VersionNotFoundError(None, self.loc.display(), [])
                return found
            return catalog.find(self.loc, version)


__all__ = ["StoreReader"]


def step_missing_message(step: int, infos: list[VersionInfo], url: str) -> str:
    """The error for ``--step STEP`` when no committed version (``infos``, oldest first) has it:
    the committed steps just below and above it, each with its (newest) version."""
    head = f"no committed version has step {step} in {url}"
    if not infos:
        return f"{head}: it has no committed versions"
    by_step = {i.step: i.version for i in infos if i.step is not None}  # oldest first: the newest wins
    if not by_step:
        listing = ", ".join(str(i.version) for i in infos)
        return f"{head}: none of its versions ({listing}) records a step; give --version instead"
    below = max((s for s in by_step if s < step), default=None)
    above = min((s for s in by_step if s > step), default=None)
    nearest = [f"step {s} (version {by_step[s]})" for s in (below, above) if s is not None]
    verb = "are" if len(nearest) > 1 else "is"
    return f"{head}: the nearest {verb} {' and '.join(nearest)} (`ckptflow ls` lists every version's step)"
