"""A store's upkeep: delete, prune, archive, collect garbage, mirror and set aside versions.

:class:`Upkeep` does what a :class:`~.store.CheckpointStore` is asked to change
in what is stored after it was committed; each waits for the store's async save in flight
first and names the store in its errors. They are for one process (rank 0, or
a job that is not running); the mechanism is in :mod:`.versions.housekeeping`
and :mod:`.remote.mirror`.

What always holds: whatever deletes (delete, prune, gc, dropping loose copies)
runs under the store's writer lease, since a save in flight looks like garbage
and a version being archived like one to prune. A store that holds the lease
(or was given it with ``write_under``, or writes for the process that holds it)
uses that one, checked first; any other store takes the lease for the call and
releases it after. While another live writer holds the store the call is
refused with :class:`StoreLockedError` naming the holder, and removes nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from .archive.tarindex import TarIndex
from .errors import CheckpointError, FormatVersionError, ManifestError
from .files.location import Location, translate_errors
from .remote import fetch, mirror
from .versions import catalog, housekeeping
from .versions import commit as protocol
from .versions.housekeeping import GarbageReport
from .versions.lease import refuse_if_held
from .versions.retention import PrunePlan, RetentionPolicy

if TYPE_CHECKING:
    from .load.store_reader import StoreReader
    from .saver import StoreSaver
    from .versions.lease import StoreLease

log = logging.getLogger("ckptflow.storage.store")


class Upkeep:
    """What :class:`~.store.CheckpointStore` does to committed versions besides reading them."""

    def __init__(
        self,
        loc: Location,
        saves: StoreSaver,
        reads: StoreReader,
        lease: Callable[[], contextlib.AbstractContextManager[StoreLease]],
    ) -> None:
        self.loc = loc
        self._saves = saves  # its async save in flight, and the lease its commits go under
        self._reads = reads
        self._lease = lease  # takes the store's writer lease for one call

    @contextlib.contextmanager
    def _removing(self) -> Iterator[None]:
        """Hold the store's writer lease while the block deletes (see the module docstring).

        Waits for the async save in flight to end first (its outcome stays the saver's). Raises
        :class:`StoreLockedError` naming the holder while another live writer has the store,
        :class:`LeaseLostError` if this store's own lease was taken over.
        """
        # Not wait_previous: its failure is the saving thread's to raise. What the next save may
        # reference stays valid while its version is committed (removal keeps every file a
        # committed version references), which the save checks (VersionWriter.content_index).
        self._saves.join_inflight()
        own = self._saves.lease
        if own is not None:
            with translate_errors(self.loc, "checking the writer lease of"):
                own.confirm()
            yield
            return
        with translate_errors(self.loc, "reading the writer lease of"):
            writes_for = refuse_if_held(self.loc, writers=self._saves.writes_for) is not None
        if writes_for:  # a training process of the run that holds the store
            yield
            return
        with self._lease():
            yield

    @contextlib.contextmanager
    def _failures(self, action: str) -> Iterator[None]:
        """A removal's failures as CheckpointErrors naming the store and the path (a file another
        process removed or changed meanwhile, a directory that filled again)."""
        try:
            with translate_errors(self.loc, action):  # a full disk, refused credentials, ... first
                yield
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            where = exc.filename or self.loc.display()
            raise CheckpointError(
                f"{action} {self.loc.display()} failed at {where}: {exc.strerror or exc}. Another "
                "process changed the store meanwhile; what is committed is intact: run it again"
            ) from exc

    def delete(self, version: int) -> None:
        """Delete a committed version (its manifest first, so a crash leaves only garbage)."""
        with self._removing(), self._failures("deleting from"):
            housekeeping.delete_version(self.loc, version)

    def prune(
        self,
        policy: RetentionPolicy | None = None,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: tuple[str, Literal["min", "max"]] | None = None,
    ) -> list[int]:
        """Delete committed versions the policy does not keep; return the numbers of those gone."""
        if policy is None:
            if keep_best is not None and (isinstance(keep_best, str) or len(keep_best) != 2):
                raise ValueError(
                    f"keep_best takes (metric, 'min' or 'max'), e.g. ('val_loss', 'min'); got {keep_best!r}"
                )
            policy = RetentionPolicy(
                keep_last=keep_last,
                keep_every=keep_every,
                keep_best=keep_best[0] if keep_best else None,
                best_mode=keep_best[1] if keep_best else None,
            )
        return list(self.apply_retention(policy).remove)

    def plan_retention(self, policy: RetentionPolicy) -> PrunePlan:
        """What :meth:`apply_retention` would do now; changes nothing (a dry run)."""
        with translate_errors(self.loc, "listing"):
            return housekeeping.plan(self.loc, policy)

    def apply_retention(self, policy: RetentionPolicy) -> PrunePlan:
        """Delete what the policy does not keep; return the plan carried out (kept, removed, held)."""
        with self._removing(), self._failures("pruning"):
            return housekeeping.prune(self.loc, policy)

    def archive(self, versions: Sequence[int], *, name: str | None = None) -> TarIndex:
        """Consolidate committed loose versions into ``archive/<name>.tar`` plus its index."""
        with translate_errors(self.loc, "archiving in"):
            return housekeeping.archive(self.loc, list(versions), name=name)

    def reindex(self) -> list[TarIndex]:
        """Rebuild, from the tarball itself, the index of every tarball whose index cannot be read."""
        from .archive.reindex import rebuild_index
        from .archive.tarballs import archive_location

        bad = self._reads.survey().bad_archives
        with translate_errors(self.loc, "rebuilding archive indexes in"):
            return [rebuild_index(archive_location(self.loc), tar) for tar in sorted(bad)]

    def drop_loose(self, versions: Sequence[int]) -> list[int]:
        """Remove the loose copies of archived versions; they load from their tarball after."""
        with self._removing(), self._failures("removing loose files from"):
            return housekeeping.drop_loose(self.loc, list(versions))

    def gc(self, *, min_age: float = 0.0, dry_run: bool = False) -> list[int]:
        """Remove what interrupted saves and archiving left (see :meth:`collect_garbage`)."""
        return list(self.collect_garbage(min_age=min_age, dry_run=dry_run).removed.versions)

    def collect_garbage(self, *, min_age: float = 0.0, dry_run: bool = False) -> GarbageReport:
        """Remove what interrupted saves and archive jobs left."""
        if dry_run:
            with translate_errors(self.loc, "listing"):
                return housekeeping.find_garbage(self.loc, min_age)
        with self._removing(), self._failures("collecting garbage in"):
            return housekeeping.collect_garbage(self.loc, min_age=min_age)

    # -- mirroring --------------------------------------------------------------

    def mirror_version(self, version: int, url: str, *, storage_options: dict[str, Any]) -> str:
        """Upload a committed loose version to the store at ``url``."""
        mirror.require_local(self.loc)
        return mirror.mirror_version(self.loc, self._reads.manifest(version), url, storage_options)

    def fetch_newest(self, url: str, *, storage_options: dict[str, Any]) -> fetch.Fetched | None:
        """Bring the newest committed version of the mirror at ``url`` here when it is newer."""
        if not self.loc.is_local:
            raise CheckpointError(
                f"{self.loc.display()} is not a local directory: a durable tier is fetched into a local one"
            )
        with self._removing(), translate_errors(self.loc, "fetching into"):  # under the writer lease
            return fetch.fetch_newest(self.loc, url, storage_options)

    def check_mirror(self, url: str, *, storage_options: dict[str, Any]) -> None:
        """Refuse ``url`` if it is the mirror of another store; write nothing."""
        mirror.bind(self.loc, url.rstrip("/"), storage_options, write=False)

    def mirror_archive(self, tar: str, url: str, *, storage_options: dict[str, Any]) -> str:
        """Upload a committed tarball to ``url``'s ``archive/``, then its index (its commit there)."""
        mirror.require_local(self.loc)
        return mirror.mirror_archive(self.loc, tar, url, storage_options)

    def set_aside_unreadable(self) -> list[tuple[int, str, CheckpointError]]:
        """Move aside the unreadable versions above the newest committed one, so a writer can go on."""
        self._saves.saver.wait_previous()
        with translate_errors(self.loc, "setting aside unreadable versions in"):
            catalog.archived_for_writing(self.loc)
            _, above = catalog.newest_and_above(self.loc)
            moved = []
            refs = catalog.references(self.loc) if above else None
            for version, record in sorted(above.items(), reverse=True):
                error = record.error or ManifestError(f"manifest of version {version} cannot be read")
                if isinstance(error, FormatVersionError):
                    raise error
                assert refs is not None
                name = protocol.set_aside(self.loc, version, keep=refs.keep(version))
                log.warning("version %d is unreadable (%s): set aside as %s", version, error, name)
                moved.append((version, self.loc.display(name), error))
        return moved
