"""CheckpointStore: save, load, list, verify, prune and collect garbage at one URL.

This is the library's front door. It composes the pure parts (structure,
planner, retention) with the mechanism (:mod:`.saving` plans, numbers, writes
and commits a version; reader, catalog) and holds the state a store needs in
memory: the async save in flight, its staging buffer, and, in
a torch.distributed job, the checkpoint's process group. Deleting, pruning,
archiving, collecting garbage and mirroring are in :mod:`.upkeep`.

What always holds: ``save`` returns only after the version is committed;
``save_async`` returns once the state is copied, and the version is committed
by the time its handle's ``wait()`` returns. A failed or interrupted save
leaves the previous committed version the latest and exposes nothing. Only
one process (or one rank group) may write to a store at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .archive.tarballs import archive_location, list_archived
from .errors import (
    ManifestError,
    UnreadableVersionError,
    VersionNotFoundError,
)
from .files.location import open_location, probe, translate_errors
from .format.manifest import Manifest
from .info import StoreOptions, VersionInfo
from .load.restore import rank_manifest, read_state
from .load.verifying import verify_version
from .save.async_save import SaveHandle
from .save.store_saver import SaveRequest, StoreSaver
from .sharded.api import ShardedStore, holds_sharded
from .upkeep import Upkeep
from .versions import catalog, metadata, nearby
from .versions import commit as protocol
from .versions.lease import DEFAULT_TIMEOUT as DEFAULT_LEASE_TIMEOUT
from .versions.lease import LEASE_KEY, StoreLease

if TYPE_CHECKING:  # the save and load paths import torch: not needed to list, prune or archive
    import torch

    from .archive.tarballs import ArchivedVersion
    from .save.distributed import RankGroup
    from .save.saving import VersionWriter
    from .save.staging import StagingBuffer

log = logging.getLogger(__name__)


class CheckpointStore(ShardedStore, Upkeep):
    """Checkpoints of one training run under an fsspec URL (path, file://, s3://, memory://).

    ``distributed=True`` (or a :class:`RankGroup`): a store shared by every rank of a
    torch.distributed job. Creating it, ``save`` and ``save_async`` are collective calls
    (every rank makes them, in the same order); each rank writes its share of the
    replicated state and rank 0 commits. Loading is not collective. Delete, prune and
    gc are for one process (rank 0, or a job that is not running).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        options: StoreOptions | None = None,
        distributed: bool | RankGroup = False,
    ) -> None:
        self.loc = open_location(url, storage_options)
        self.options = options or StoreOptions()
        self.group: RankGroup | None = None
        if distributed:
            from .save.distributed import RankGroup

            self.group = distributed if isinstance(distributed, RankGroup) else RankGroup.create()
        self._saves = StoreSaver(self.loc, self.options, self.group)
        self._saver = self._saves.saver

    @property
    def _writer(self) -> VersionWriter:
        """The save path (made on the first save, with torch)."""
        return self._saves.writer

    @property
    def _staging(self) -> StagingBuffer:
        return self._saves.staging

    @property
    def rank(self) -> int:
        return self.group.rank if self.group else 0

    @property
    def world_size(self) -> int:
        return self.group.world_size if self.group else 1

    @property
    def url(self) -> str:
        """The store's URL without credentials."""
        return self.loc.display()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def probe(self, *, must_exist: bool) -> bool:
        """Whether anything is stored here: one listing, failing with a clear error on a missing
        bucket, missing or refused credentials or an unreachable endpoint.

        ``must_exist``: an empty or missing store is an error too (a mistyped URL). Open the
        store with :func:`quick_answer_options` for an answer within seconds.
        """
        return probe(self.loc, must_exist=must_exist)

    def version_url(self, version: int) -> str:
        """The URL (without credentials) of a version's own directory, whether or not it exists."""
        return self.loc.display(protocol.version_dir(version))

    def tarball_url(self, tar: str) -> str:
        """The URL (without credentials) of the tarball named ``tar`` in the store's ``archive/``."""
        return archive_location(self.loc).display(tar)

    # -- saving ---------------------------------------------------------------

    def save(
        self,
        state: object,
        *,
        epoch: int | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        version: int | None = None,
        user: dict[str, Any] | None = None,
        rank_state: object = None,
    ) -> VersionInfo:
        """Write ``state`` as a new committed version and return it.

        ``rank_state``: this process's own state (RNG states, data position), kept apart
        from ``state``; in a distributed store ``state`` is the replicated state, the
        same on every rank, and each rank passes its own ``rank_state``.
        """
        request = SaveRequest(epoch, step, metrics, version, user, rank_state)
        if holds_sharded(state):  # DTensors, or objects with state_dict(): DCP plans the save
            return self._save_sharded(state, request)
        return self._saves.save(state, request)

    def save_async(
        self,
        state: object,
        *,
        epoch: int | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        version: int | None = None,
        user: dict[str, Any] | None = None,
        rank_state: object = None,
    ) -> SaveHandle:
        """Copy ``state`` to host memory, then write and commit it in the background.

        Returns once the copy is done: the caller may change its tensors. At
        most one save is in flight; a second call waits for the first and
        raises its failure, if it failed and nobody called ``wait()``. In a
        distributed store each rank copies only the share it writes.
        """
        request = SaveRequest(epoch, step, metrics, version, user, rank_state)
        if holds_sharded(state):
            return self._save_sharded_async(state, request)
        return self._saves.save_async(state, request)

    # -- one writer per store ---------------------------------------------------

    @contextlib.contextmanager
    def lease(
        self, *, owner: str | None = None, timeout: float = DEFAULT_LEASE_TIMEOUT
    ) -> Iterator[StoreLease]:
        """Hold the store's writer lease while the block runs; commits then need it.

        Raises :class:`StoreLockedError` naming the holder if another live writer has it; a
        lease not renewed for its holder's ``timeout`` seconds (or whose process, of this host
        and pid space, has ended) is taken over. It is renewed in the background and released at the end,
        after the async save in flight, if any, has ended. One process holds it for a job:
        in a torch.distributed job, the launcher (the ranks write for it), not every rank.
        """
        held = StoreLease(self.loc, owner=owner, timeout=timeout)
        with translate_errors(self.loc, "taking the writer lease on"):
            held.acquire()
        self.write_under(held)
        try:
            yield held
        finally:
            try:
                self._saves.join_inflight()
            finally:
                self.write_under(None)
                held.release()

    def write_under(self, lease: StoreLease | None) -> None:
        """Make this store's commits need ``lease`` (held by this process, e.g. through another
        store object on the same URL); None: commit without one."""
        self._saves.write_under(lease)

    def write_for(self, pids: Collection[int]) -> None:
        """Let this store commit under a lease that one of ``pids`` (processes of this host) holds:
        a training process writing for the run that holds the store. Without it, or
        :meth:`write_under`, a save is refused while any live writer holds the store."""
        self._saves.write_for(frozenset(pids))

    def committed_by_this_writer(self, version: int) -> bool:
        """Whether ``version`` is committed under the lease this store writes under (its own save,
        e.g. one whose answer a retry missed), rather than by another writer."""
        lease = self._saves.lease
        found = self.find(version)
        if lease is None or found is None:
            return False
        return self.manifest(version).writer.get(LEASE_KEY) == lease.token

    def wait(self) -> VersionInfo | None:
        """Wait for the async save in flight, if any; raise its failure."""
        return self._saver.wait_previous()

    # -- reading --------------------------------------------------------------

    def versions(self) -> list[VersionInfo]:
        """Committed versions, loose and archived, oldest first."""
        with translate_errors(self.loc, "listing"):
            return [self._info(x) for x in catalog.committed(self.loc)]

    def latest(self) -> VersionInfo | None:
        """The newest committed version (the one a resumed run starts from), or None."""
        with translate_errors(self.loc, "listing"):
            found = catalog.newest(self.loc)
        return self._info(found) if found else None

    def info(self, version: int | None = None) -> VersionInfo:
        """One committed version (the newest when ``version`` is None); raises if not committed."""
        return self._info(self._locate(version))

    def find(self, version: int) -> VersionInfo | None:
        """A committed version, or None if ``version`` is not committed (without listing the others)."""
        with translate_errors(self.loc, "reading"):
            found = catalog.lookup(self.loc, version)
        return self._info(found) if found is not None else None

    def manifest(self, version: int | None = None) -> Manifest:
        """The manifest of a committed version (the newest when ``version`` is None)."""
        return self._locate(version).manifest

    def load(
        self,
        version: int | None = None,
        *,
        keys: Sequence[str] | None = None,
        map_location: str | torch.device = "cpu",
        verify: bool | None = None,
        into: Any = None,
    ) -> Any:
        """The state saved in ``version`` (default: the newest committed one).

        ``keys`` selects parts by slash-separated key path (``["model"]``,
        ``["optimizer/param_groups"]``); only their bytes are read. ``into``: a
        state of existing tensors (e.g. ``{"model": model.state_dict()}``);
        tensors whose key path, dtype and shape match are read into them in
        place (GPU tensors through a host copy) and returned as those very
        tensors. Archived versions are read
        from their tarball by range reads.
        """
        if into is not None and holds_sharded(into):  # DTensors: every rank reads the parts it holds
            if keys:
                raise ValueError("keys cannot select parts of a sharded load: pass only those parts in into")
            return self._load_sharded(version, into, verify)
        located = self._locate(version)
        return self._read(located, located.manifest, keys, map_location, verify, into)

    def load_rank_state(
        self,
        version: int | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        map_location: str | torch.device = "cpu",
        verify: bool | None = None,
    ) -> Any:
        """The ``rank_state`` rank ``rank`` saved (default: this store's rank), or None if none was saved.

        Saved by the same number of ranks: rank r gets what rank r saved. Saved by a
        different number: every rank gets rank 0's, with a :class:`RankStateWarning`;
        the caller decides what must differ per rank (the pipeline reseeds the RNGs of
        ranks above 0 from the run's seed, the epoch and the rank).
        """
        located = self._locate(version)
        rank = self.rank if rank is None else rank
        world = self.world_size if world_size is None else world_size
        manifest = rank_manifest(located.manifest, rank, world, stacklevel=2)
        if manifest is None:
            return None
        return self._read(located, manifest, None, map_location, verify, None)

    def _read(
        self,
        located: catalog.Located,
        manifest: Manifest,
        keys: Sequence[str] | None,
        map_location: str | torch.device,
        verify: bool | None,
        into: Any,
    ) -> Any:
        return read_state(self.loc, self.options, located, manifest, keys, map_location, verify, into)

    def verify(self, version: int | None = None) -> VersionInfo:
        """Check every byte of a version (loose or archived) against its checksums, and its tar structure.

        With no ``version``, the newest: when the newest version's manifest is unreadable,
        that is the finding (:class:`UnreadableVersionError`), not a reason to check an older one.
        """
        if version is None:
            with translate_errors(self.loc, "reading"):
                found, above = catalog.newest_and_above(self.loc)
            if above:
                top = max(above)
                error = above[top].error or ManifestError(f"manifest of version {top} cannot be read")
                raise UnreadableVersionError(top, self.url, error, found.version if found else None)
            if found is None:
                raise VersionNotFoundError(None, self.url, [])
            return self.verify_located(found)
        return self.verify_located(self._locate(version))

    def verify_located(self, located: catalog.Located) -> VersionInfo:
        """Check the shards of a version found by :meth:`survey` (no second look-up)."""
        with translate_errors(self.loc, "verifying"):
            located.check_tarball(self.loc, whole=True)
            verify_version(self.loc, located.manifest, located.sources(self.loc))
        return self._info(located)

    def survey(self) -> catalog.Survey:
        """Every version by state: committed (loose or archived), unreadable, being written, set aside."""
        with translate_errors(self.loc, "listing"):
            return catalog.survey(self.loc)

    def version_dirs(self) -> dict[int, bool]:
        """Every version directory, by number, and whether it holds a manifest file.

        One listing, no manifest read: one without a manifest is being written or was left by an
        interrupted save; one with a manifest is committed unless its manifest is unreadable.
        """
        with translate_errors(self.loc, "listing"):
            return protocol.list_dirs(self.loc)

    def misplaced(self) -> nearby.VersionDirectory | nearby.StoresBelow | None:
        """What the URL is when it is a version's directory or holds stores; None for a store."""
        with translate_errors(self.loc, "listing"):
            return nearby.misplaced(self.loc)

    def archived(self) -> dict[int, ArchivedVersion]:
        """The versions in committed tarballs, by number, each with its tarball's name and index.

        Reads only the tarball indexes; a tarball whose index cannot be read is left out (with a
        warning in the log; :meth:`survey` names it).
        """
        with translate_errors(self.loc, "listing"):
            return list_archived(self.loc)

    def info_of(self, located: catalog.Located) -> VersionInfo:
        """The listing entry of a version found by :meth:`survey`."""
        return self._info(located)

    def _info(self, located: catalog.Located) -> VersionInfo:
        return VersionInfo.from_manifest(
            located.manifest, located.url(self.loc), archived=located.is_archived
        )

    def _committed(self) -> list[Manifest]:
        """Manifests of the committed versions (loose and archived), oldest first."""
        with translate_errors(self.loc, "listing"):
            return [x.manifest for x in catalog.committed(self.loc)]

    def _locate(self, version: int | None) -> catalog.Located:
        """A committed version and where it lives; raise a clear error for any other state."""
        with translate_errors(self.loc, "reading"):
            if version is None:
                found = catalog.newest(self.loc)
                if found is None:
                    raise VersionNotFoundError(None, self.url, [])
                return found
            return catalog.find(self.loc, version)

    # -- run metadata ---------------------------------------------------------

    def read_json(self, name: str) -> Any:
        """A JSON document stored beside the versions (e.g. ``run.json``), or None."""
        return metadata.read_json(self.loc, name)

    def write_json(self, name: str, value: Any) -> None:
        """Store a JSON document beside the versions, atomically."""
        metadata.write_json(self.loc, name, value)

    def close(self) -> None:
        """Wait for the async save in flight and release the staging buffer."""
        self._saves.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
