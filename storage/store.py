"""CheckpointStore: save, load, list, verify, prune and collect garbage at one URL.

This is the library's front door, a facade over three parts with one job each:
a :class:`~.saver.StoreSaver` (the save path, its staging buffer and
the async save in flight: every save, plain, from ranks or of sharded state,
runs the same phases), a :class:`~.load.store_reader.StoreReader` (the catalog
of versions and reading states back, DCP's loads included) and an
:class:`~.upkeep.Upkeep` (delete, prune, archive, gc, mirror). The store holds
what they share: the location, the options, the writer lease and, in a
torch.distributed job, the checkpoint's process group.

What always holds: ``save`` returns only after the version is committed;
``save_async`` returns once the state is copied, and the version is committed
by the time its handle's ``wait()`` returns. A failed or interrupted save
leaves the previous committed version the latest and exposes nothing. Only
one process (or one rank group) may write to a store at a time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from .archive.tarballs import archive_location
from .errors import CheckpointError, VersionNotFoundError
from .files import nearby
from .files.location import open_location, probe, translate_errors
from .format.entries import Lineage
from .format.manifest import Manifest
from .info import SaveRequest, StoreOptions, VersionInfo
from .load.store_reader import StoreReader
from .save.async_save import SaveHandle
from .save.group import RankGroup
from .save.kinds import holds_sharded
from .saver import StoreSaver
from .upkeep import Upkeep
from .versions import catalog, metadata
from .versions import commit as protocol
from .versions.lease import DEFAULT_TIMEOUT as DEFAULT_LEASE_TIMEOUT
from .versions.lease import LEASE_KEY, StoreLease, refuse_if_held

if TYPE_CHECKING:  # the save and load paths import torch: not needed to list, prune or archive
    import torch

    from .archive.tarballs import ArchivedVersion
    from .archive.tarindex import TarIndex
    from .diff import StateDiff
    from .remote.fetch import Fetched
    from .sharded.reader import DcpReader
    from .sharded.writer import DcpWriter
    from .versions.housekeeping import GarbageReport
    from .versions.lease_info import LeaseInfo
    from .versions.retention import PrunePlan, RetentionPolicy


class CheckpointStore:
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
        # One process is the group of one (RankGroup.solo): every save and load runs the same phases.
        self.group = RankGroup.solo()
        if distributed:
            self.group = distributed if isinstance(distributed, RankGroup) else RankGroup.create()
        self._saves = StoreSaver(self.loc, self.options, self.group)
        self._reads = StoreReader(self.loc, self.options, self.group)
        self._upkeep = Upkeep(self.loc, self._saves, self._reads, self.lease)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def url(self) -> str:
        """The store's URL without credentials."""
        return self.loc.display()

    @property
    def canonical_url(self) -> str:
        """The store's one name however its URL was written (relative, absolute, ``file://``, through
        a symbolic link): a local store's real path, else its URL without credentials."""
        return self.loc.canonical()

    @property
    def fences_commits(self) -> bool:
        """Whether removals and commits exclude each other here (a local disk's flock of the root):
        a save never commits a reference to a file a removal in another process sweeps meanwhile.
        On object stores they do not; see :mod:`.versions.housekeeping`."""
        return self.loc.is_local

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

    def display(self, name: str = "") -> str:
        """The URL (without credentials) of ``name`` inside the store (e.g. a set-aside directory)."""
        return self.loc.display(name)

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
        lineage: Lineage | Mapping[str, Any] | None = None,
    ) -> VersionInfo:
        """Write ``state`` as a new committed version and return it.

        ``rank_state``: this process's own state (RNG states, data position), kept apart
        from ``state``; in a distributed store ``state`` is the replicated state, the
        same on every rank, and each rank passes its own ``rank_state``.

        ``lineage``: where the state came from, a :class:`Lineage` or a dict of its fields
        (``parent``, ``run``, ``spec``, ``config_hash``, ``code``); the parent defaults to the
        version this store object last loaded or committed, so that resumes and forks show in
        ``ckptflow log``.
        """
        request = SaveRequest(epoch, step, metrics, version, user, rank_state, Lineage.given(lineage))
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
        lineage: Lineage | Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Copy ``state`` to host memory, then write and commit it in the background.

        Returns once the copy is done: the caller may change its tensors. At
        most one save is in flight; a second call waits for the first and
        raises its failure, if it failed and nobody called ``wait()``. In a
        distributed store each rank copies only the share it writes.
        """
        request = SaveRequest(epoch, step, metrics, version, user, rank_state, Lineage.given(lineage))
        return self._saves.save_async(state, request)

    def dcp_writer(
        self,
        *,
        epoch: int | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        version: int | None = None,
        user: dict[str, Any] | None = None,
    ) -> DcpWriter:
        """A StorageWriter for one ``dcp.save``/``dcp.async_save``: it becomes a committed version."""
        return self._saves.dcp_writer(SaveRequest(epoch, step, metrics, version, user))

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

    def refuse_if_held(self, *, writers: Collection[int] = ()) -> LeaseInfo | None:
        """Raise :class:`StoreLockedError` naming the holder if another live writer holds the store;
        the lease's holder if it is one of ``writers`` (processes this one writes for), else None."""
        with translate_errors(self.loc, "reading the writer lease of"):
            return refuse_if_held(self.loc, writers=set(writers))

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
        return self._saves.saver.wait_previous()

    # -- reading --------------------------------------------------------------

    def versions(self) -> list[VersionInfo]:
        """Committed versions, loose and archived, oldest first."""
        return self._reads.versions()

    def latest(self) -> VersionInfo | None:
        """The newest committed version (the one a resumed run starts from), or None."""
        return self._reads.latest()

    def best(self, metric: str, mode: Literal["min", "max"]) -> VersionInfo:
        """The committed version with the best ``metric`` (``mode``: ``"max"`` if higher is better,
        an accuracy; ``"min"`` if lower is, a loss: there is no default); ties go to the newest.
        Versions without the metric are passed over; VersionNotFoundError when none has it,
        naming the metrics they have."""
        if mode not in ("min", "max"):
            raise ValueError(
                f"mode must be 'max' (a higher {metric} is better) or 'min' (a lower one is), got {mode!r}"
            )
        from .versions.retention import ranked_by

        infos = self.versions()
        scored = ranked_by(infos, metric, mode)
        if not scored:
            known = sorted({name for i in infos for name in i.metrics})
            have = f"their metrics: {', '.join(known)}" if known else "they record no metrics"
            raise VersionNotFoundError(
                None,
                self.loc.display(),
                [i.version for i in infos],
                reason=f"no committed version records the metric {metric!r} ({have})",
            )
        return scored[0]

    def info(self, version: int | None = None) -> VersionInfo:
        """One committed version (the newest when ``version`` is None); raises if not committed."""
        return self._reads.info(version)

    def find(self, version: int) -> VersionInfo | None:
        """A committed version, or None if ``version`` is not committed (without listing the others)."""
        return self._reads.find(version)

    def find_step(self, step: int) -> VersionInfo | None:
        """The committed version saved at global step ``step`` (the newest, if several were), or None.

        Reads every committed manifest, loose and archived: a step is not part of a version's name.
        """
        return self._reads.find_step(step)

    def version_at_step(self, step: int) -> int:
        """The number of the committed version saved at global step ``step`` (the newest, if
        several were); VersionNotFoundError names the committed steps nearest to it."""
        return self._reads.version_at(step)

    def manifest(self, version: int | None = None) -> Manifest:
        """The manifest of a committed version (the newest when ``version`` is None)."""
        return self._reads.manifest(version)

    def load(
        self,
        version: int | None = None,
        *,
        keys: Sequence[str] | None = None,
        map_location: str | torch.device = "cpu",
        verify: bool | None = None,
        into: Any = None,
        step: int | None = None,
    ) -> Any:
        """The state saved in ``version`` (default: the newest committed one), or at global
        training step ``step`` (VersionNotFoundError names the steps nearest to it).

        ``keys`` selects parts by slash-separated key path (``["model"]``,
        ``["optimizer/param_groups"]``); only their bytes are read. ``into``: a
        state of existing tensors (e.g. ``{"model": model.state_dict()}``);
        tensors whose key path, dtype and shape match are read into them in
        place (GPU tensors through a host copy) and returned as those very
        tensors. Archived versions are read
        from their tarball by range reads.
        """
        if step is not None:
            if version is not None:
                raise ValueError("give either version or step, not both")
            version = self.version_at_step(step)
        if into is not None and holds_sharded(into):  # DTensors: every rank reads the parts it holds
            if keys:
                raise ValueError("keys cannot select parts of a sharded load: pass only those parts in into")
            from .sharded import dcp_calls

            self._saves.join_inflight()  # an async save's collectives use the same group: not beside these
            return dcp_calls.load(self.loc, self.options, self.group, self._loaded, version, into, verify)
        located = self._loaded(version)
        return self._reads.load_located(
            located, keys=keys, map_location=map_location, verify=verify, into=into
        )

    def _loaded(self, version: int | None) -> catalog.Located:
        """The version a load reads, which becomes the parent of this store's next save."""
        located = self._locate(version)
        self._saves.loaded(located.version)
        return located

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
        return self._reads.load_rank_state(
            version, rank=rank, world_size=world_size, map_location=map_location, verify=verify
        )

    def diff(
        self,
        a: int | None,
        b: int | str | os.PathLike[str] | CheckpointStore | None = None,
        *,
        values: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> StateDiff:
        """What changed from version ``a`` to ``b`` (None: the newest committed version):
        tensors added, removed, retyped, reshaped or changed in value (told by their checksums,
        without reading them), and the other values of the state that changed.

        ``b`` may also be a ``torch.save`` or safetensors file, another store, or another store's
        URL (``URL@N`` for its version N; ``storage_options`` open it). ``values=True`` reads the
        tensors that changed and adds the bytes that differ, the largest absolute difference and
        the relative norm of the difference.
        """
        from .diff import compare, file_side, no_side, split_version, version_side

        before = version_side(self._reads, a)  # read by the store's reader: a diff sets no parent
        if b is None or isinstance(b, int):
            after = version_side(self._reads, b)
        elif isinstance(b, CheckpointStore):
            after = version_side(b._reads, None)
        elif str(b).isdigit() or str(b) == "latest":
            after = version_side(self._reads, None if str(b) == "latest" else int(str(b)))
        else:
            found = file_side(b)
            if found is None:
                url, number = split_version(os.fspath(b))
                other = CheckpointStore(url, storage_options=storage_options)
                if not other.probe(must_exist=False):
                    raise no_side(os.fspath(b))
                found = version_side(other._reads, number)
            after = found
        return compare(before, after, values=values)

    def verify(self, version: int | None = None) -> VersionInfo:
        """Check every byte of a version (loose or archived) against its checksums, and its tar structure.

        With no ``version``, the newest: when the newest version's manifest is unreadable,
        that is the finding (:class:`UnreadableVersionError`), not a reason to check an older one.
        """
        return self._reads.verify(version)

    def verify_located(self, located: catalog.Located) -> VersionInfo:
        """Check the shards of a version found by :meth:`survey` (no second look-up)."""
        return self._reads.verify_located(located)

    def survey(self) -> catalog.Survey:
        """Every version by state: committed (loose or archived), unreadable, being written, set aside."""
        return self._reads.survey()

    def version_dirs(self) -> dict[int, bool]:
        """Every version directory, by number, and whether it holds a manifest file.

        One listing, no manifest read: one without a manifest is being written or was left by an
        interrupted save; one with a manifest is committed unless its manifest is unreadable.
        """
        return self._reads.version_dirs()

    def misplaced(self) -> nearby.VersionDirectory | nearby.StoresBelow | None:
        """What the URL is when it is a version's directory or holds stores; None for a store."""
        return self._reads.misplaced()

    def archived(self) -> dict[int, ArchivedVersion]:
        """The versions in committed tarballs, by number, each with its tarball's name and index.

        Reads only the tarball indexes; a tarball whose index cannot be read is left out (with a
        warning in the log; :meth:`survey` names it).
        """
        return self._reads.archived()

    def dcp_reader(self, *, version: int | None = None, verify: bool | None = None) -> DcpReader:
        """A StorageReader of a committed version (the newest when ``version`` is None) for ``dcp.load``."""
        from .sharded import dcp_calls

        return dcp_calls.new_reader(self.loc, self.options, self._locate(version), verify)

    def info_of(self, located: catalog.Located) -> VersionInfo:
        """The listing entry of a version found by :meth:`survey`."""
        return self._reads.info_of(located)

    def _locate(self, version: int | None) -> catalog.Located:
        """A committed version and where it lives; raise a clear error for any other state."""
        return self._reads.locate(version)

    # -- upkeep -------------------------------------------------------------------

    def delete(self, version: int) -> None:
        """Delete a committed version (its manifest first, so a crash leaves only garbage)."""
        return self._upkeep.delete(version)

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
        return self._upkeep.prune(policy, keep_last=keep_last, keep_every=keep_every, keep_best=keep_best)

    def plan_retention(self, policy: RetentionPolicy) -> PrunePlan:
        """What :meth:`apply_retention` would do now; changes nothing (a dry run)."""
        return self._upkeep.plan_retention(policy)

    def apply_retention(self, policy: RetentionPolicy) -> PrunePlan:
        """Delete what the policy does not keep; return the plan carried out (kept, removed, held)."""
        return self._upkeep.apply_retention(policy)

    def archive(self, versions: Sequence[int], *, name: str | None = None) -> TarIndex:
        """Consolidate committed loose versions into ``archive/<name>.tar`` plus its index.

        The loose copies stay until :meth:`drop_loose`: remove them only once the
        tarball is where it must be (uploaded and verified, when you upload).
        """
        return self._upkeep.archive(versions, name=name)

    def reindex(self) -> list[TarIndex]:
        """Rebuild, from the tarball itself, the index of every tarball whose index cannot be read."""
        return self._upkeep.reindex()

    def drop_loose(self, versions: Sequence[int]) -> list[int]:
        """Remove the loose copies of archived versions; they load from their tarball after."""
        return self._upkeep.drop_loose(versions)

    def gc(self, *, min_age: float = 0.0, dry_run: bool = False) -> list[int]:
        """Remove what interrupted saves and archiving left (see :meth:`collect_garbage`).

        Return the versions removed (``dry_run``: that it would remove).
        """
        return self._upkeep.gc(min_age=min_age, dry_run=dry_run)

    def collect_garbage(self, *, min_age: float = 0.0, dry_run: bool = False) -> GarbageReport:
        """Remove what interrupted saves and archive jobs left: version directories without a
        manifest, tarballs without an index, temp files of atomic writes. Return what was
        removed and what was spared.

        ``min_age`` seconds: spare what changed more recently (a writer without the lease may
        still be writing it). ``dry_run``: remove nothing, report what it would remove.
        """
        return self._upkeep.collect_garbage(min_age=min_age, dry_run=dry_run)

    def mirror_version(self, version: int, url: str, *, storage_options: dict[str, Any]) -> str:
        """Upload a committed loose version to the store at ``url``: each shard uploaded and verified,
        then its manifest, the version's commit there. Returns the version's URL on the mirror.

        Copies from a local store; a copy already there and verified is skipped. Give
        ``storage_options`` made by :func:`upload_storage_options`.
        """
        return self._upkeep.mirror_version(version, url, storage_options=storage_options)

    def fetch_newest(self, url: str, *, storage_options: dict[str, Any] | None = None) -> Fetched | None:
        """Bring the newest committed version of this store's mirror at ``url`` (its durable tier)
        here when it is newer than the newest this store holds: the files it needs and this store
        lacks, each verified, then its manifest, as a save commits. Returns what was fetched, or
        None when this store is as new. An empty store takes the mirror's identity; a store
        holding another store's versions is refused. Under the writer lease, as removals are.
        """
        return self._upkeep.fetch_newest(url, storage_options=storage_options or {})

    def check_mirror(self, url: str, *, storage_options: dict[str, Any]) -> None:
        """Raise CheckpointError, naming both stores, if ``url`` is another store's mirror (a mirror
        belongs to one store; the first upload makes ``url`` this store's). Writes nothing."""
        self._upkeep.check_mirror(url, storage_options=storage_options)

    def mirror_archive(self, tar: str, url: str, *, storage_options: dict[str, Any]) -> str:
        """Upload a committed tarball to ``url``'s ``archive/``, then its index (its commit there).

        Returns the tarball's URL on the mirror. As :meth:`mirror_version`, from a local store.
        """
        return self._upkeep.mirror_archive(tar, url, storage_options=storage_options)

    def set_aside_unreadable(self) -> list[tuple[int, str, CheckpointError]]:
        """Move aside the unreadable versions above the newest committed one, so a writer can go on.

        Returns (version, new directory URL, why) for each. Their directories are renamed, never
        deleted (see :func:`.commit.set_aside`). A version written by a newer ckptflow is not moved:
        that raises its FormatVersionError (upgrade instead). Nothing is moved while a tarball's
        index cannot be read: its versions, maybe the newest, are unknown (CheckpointError).
        """
        return self._upkeep.set_aside_unreadable()

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
