"""A store's upkeep: delete, prune, archive, collect garbage, mirror and set aside versions.

These are the :class:`~.store.CheckpointStore` methods that change what is
stored after it was committed; each waits for the store's async save in flight
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
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from .archive.tarindex import TarIndex
from .errors import CheckpointError, FormatVersionError, ManifestError
from .files.location import Location, translate_errors
from .remote import mirror
from .versions import catalog, housekeeping
from .versions import commit as protocol
from .versions.housekeeping import GarbageReport
from .versions.lease import refuse_if_held
from .versions.retention import PrunePlan, RetentionPolicy

if TYPE_CHECKING:
    from .format.manifest import Manifest
    from .save.async_save import AsyncSaver
    from .save.store_saver import StoreSaver
    from .versions.lease import StoreLease

log = logging.getLogger("ckptflow.storage.store")


class Upkeep:
    """What :class:`~.store.CheckpointStore` does to committed versions besides reading them."""

    loc: Location
    _saver: AsyncSaver
    _saves: StoreSaver

    if TYPE_CHECKING:

        def survey(self) -> catalog.Survey: ...

        def manifest(self, version: int | None = None) -> Manifest: ...

        def lease(
            self, *, owner: str | None = None, timeout: float = ...
        ) -> contextlib.AbstractContextManager[StoreLease]: ...

    @contextlib.contextmanager
    def _removing(self) -> Iterator[None]:
        """Hold the store's writer lease while the block deletes (see the module docstring).

        Waits for the async save in flight to end first (its outcome stays the saver's). Raises
        :class:`StoreLockedError` naming the holder while another live writer has the store,
        :class:`LeaseLostError` if this store's own lease was taken over.
        """
        self._saves.join_inflight()  # not wait_previous: its failure is the saving thread's to raise
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
        with self.lease():
            yield

    def delete(self, version: int) -> None:
        """Delete a committed version (its manifest first, so a crash leaves only garbage)."""
        with self._removing(), translate_errors(self.loc, "deleting from"):
            housekeeping.delete_version(self.loc, version)

    def prune(
        self,
        policy: RetentionPolicy | None = None,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: tuple[str, Literal["min", "max"]] | None = None,
    ) -> list[int]:
        """Delete committed versions the policy does not keep; return the numbers of those gone.

        A tarball is removed whole: a version it shares with a kept version stays
        (see :meth:`apply_retention`, which says which).
        """
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
        with self._removing(), translate_errors(self.loc, "pruning"):
            return housekeeping.prune(self.loc, policy)

    def archive(self, versions: Sequence[int], *, name: str | None = None) -> TarIndex:
        """Consolidate committed loose versions into ``archive/<name>.tar`` plus its index.

        The loose copies stay until :meth:`drop_loose`: remove them only once the
        tarball is where it must be (uploaded and verified, when you upload).
        """
        with translate_errors(self.loc, "archiving in"):
            return housekeeping.archive(self.loc, list(versions), name=name)

    def reindex(self) -> list[TarIndex]:
        """Rebuild, from the tarball itself, the index of every tarball whose index cannot be read."""
        from .archive.reindex import rebuild_index
        from .archive.tarballs import archive_location

        bad = self.survey().bad_archives
        with translate_errors(self.loc, "rebuilding archive indexes in"):
            return [rebuild_index(archive_location(self.loc), tar) for tar in sorted(bad)]

    def drop_loose(self, versions: Sequence[int]) -> list[int]:
        """Remove the loose copies of archived versions; they load from their tarball after."""
        with self._removing(), translate_errors(self.loc, "removing loose files from"):
            return housekeeping.drop_loose(self.loc, list(versions))

    def gc(self, *, min_age: float = 0.0, dry_run: bool = False) -> list[int]:
        """Remove what interrupted saves and archiving left (see :meth:`collect_garbage`).

        Return the versions removed (``dry_run``: that it would remove).
        """
        return list(self.collect_garbage(min_age=min_age, dry_run=dry_run).removed.versions)

    def collect_garbage(self, *, min_age: float = 0.0, dry_run: bool = False) -> GarbageReport:
        """Remove what interrupted saves and archive jobs left: version directories without a
        manifest, tarballs without an index, temp files of atomic writes. Return what was
        removed and what was spared.

        ``min_age`` seconds: spare what changed more recently (a writer without the lease may
        still be writing it). ``dry_run``: remove nothing, report what it would remove.
        """
        if dry_run:
            with translate_errors(self.loc, "listing"):
                return housekeeping.find_garbage(self.loc, min_age)
        with self._removing(), translate_errors(self.loc, "collecting garbage in"):
            return housekeeping.collect_garbage(self.loc, min_age=min_age)

    # -- mirroring --------------------------------------------------------------

    def mirror_version(self, version: int, url: str, *, storage_options: dict[str, Any]) -> str:
        """Upload a committed loose version to the store at ``url``: each shard uploaded and verified,
        then its manifest, the version's commit there. Returns the version's URL on the mirror.

        Copies from a local store; a copy already there and verified is skipped. Give
        ``storage_options`` made by :func:`upload_storage_options`.
        """
        mirror.require_local(self.loc)
        return mirror.mirror_version(self.loc, self.manifest(version), url, storage_options)

    def mirror_archive(self, tar: str, url: str, *, storage_options: dict[str, Any]) -> str:
        """Upload a committed tarball to ``url``'s ``archive/``, then its index (its commit there).

        Returns the tarball's URL on the mirror. As :meth:`mirror_version`, from a local store.
        """
        mirror.require_local(self.loc)
        return mirror.mirror_archive(self.loc, tar, url, storage_options)

    def set_aside_unreadable(self) -> list[tuple[int, str, CheckpointError]]:
        """Move aside the unreadable versions above the newest committed one, so a writer can go on.

        Returns (version, new directory URL, why) for each. Their directories are renamed, never
        deleted (see :func:`.commit.set_aside`). A version written by a newer ckptflow is not moved:
        that raises its FormatVersionError (upgrade instead). Nothing is moved while a tarball's
        index cannot be read: its versions, maybe the newest, are unknown (CheckpointError).
        """
        self._saver.wait_previous()
        with translate_errors(self.loc, "setting aside unreadable versions in"):
            catalog.archived_for_writing(self.loc)
            _, above = catalog.newest_and_above(self.loc)
            moved = []
            for version, record in sorted(above.items(), reverse=True):
                error = record.error or ManifestError(f"manifest of version {version} cannot be read")
                if isinstance(error, FormatVersionError):
                    raise error
                name = protocol.set_aside(self.loc, version)
                log.warning("version %d is unreadable (%s): set aside as %s", version, error, name)
                moved.append((version, self.loc.display(name), error))
        return moved
