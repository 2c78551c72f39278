"""The save side of a store: what a :class:`CheckpointStore` holds in memory to write versions.

A store makes its :class:`VersionWriter` and its one staging buffer on the first save (they
import torch; listing, pruning and archiving must not), keeps the one async save in
flight, and hands its writer the lease its commits need. Every save goes through here, in
one of two ways decided by the state alone: the store's own planner, or DCP's for a state
that holds DTensors or ``Stateful`` objects (:mod:`.sharded.dcp_calls`); both run the
writer's phases and stage through the same buffer.

Always: at most one save is in flight, and every save waits for the previous one (raising
its failure, if nobody did); the staging buffer is released when the store is closed.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

from .collector import collector_paused
from .errors import CheckpointError
from .files.location import Location
from .format.entries import Lineage
from .info import SaveRequest, StoreOptions, VersionInfo
from .save.async_save import AsyncSaver, SaveHandle
from .save.kinds import holds_sharded

if TYPE_CHECKING:
    from .save.group import RankGroup
    from .save.saving import VersionWriter
    from .save.staging import StagingBuffer
    from .sharded.writer import DcpWriter
    from .versions.lease import StoreLease


class StoreSaver:
    """The writer, the staging buffer and the async save in flight of one store."""

    def __init__(self, loc: Location, options: StoreOptions, group: RankGroup) -> None:
        self.loc = loc
        self.options = options
        self.group = group
        self.saver = AsyncSaver(self._committed)
        # The version this store last loaded or committed: the parent of its next save's lineage.
        self.parent: int | None = None
        self._lock = threading.Lock()
        self._made_writer: VersionWriter | None = None
        self._made_staging: StagingBuffer | None = None
        self._lease: StoreLease | None = None
        self._writes_for: frozenset[int] = frozenset()
        self._open_writer: DcpWriter | None = None  # the last made for a dcp.save of the caller's own

    @property
    def writer(self) -> VersionWriter:
        """The save path (made on the first save, with torch)."""
        with self._lock:
            if self._made_writer is None:
                from .save.saving import VersionWriter

                writer = VersionWriter(self.loc, self.options, self.group)
                writer.lease, writer.writes_for = self._lease, self._writes_for
                self._made_writer = writer
            return self._made_writer

    @property
    def staging(self) -> StagingBuffer:
        with self._lock:
            if self._made_staging is None:
                from .save.staging import StagingBuffer

                self._made_staging = StagingBuffer()
            return self._made_staging

    def save(self, state: object, request: SaveRequest) -> VersionInfo:
        """Write ``state`` and commit it before returning."""
        self.saver.wait_previous()
        with collector_paused():
            info = self._save(state, self._with_parent(request))
        self._committed(info)
        return info

    def _with_parent(self, request: SaveRequest) -> SaveRequest:
        """``request`` with this store's last loaded or committed version as its lineage's parent,
        unless it names one."""
        with self._lock:
            self._settle()
            parent = self.parent
        lineage = (request.lineage or Lineage()).with_parent(parent)
        return dataclasses.replace(request, lineage=Lineage.given(lineage))

    def _committed(self, info: VersionInfo) -> None:
        """A save of this store committed (an async one from its writing thread): the next parent,
        unless a dcp.save of the caller's own committed a later version meanwhile."""
        with self._lock:
            settled = self._settle()
            self.parent = max(info.version, settled) if settled is not None else info.version

    def _save(self, state: object, request: SaveRequest) -> VersionInfo:
        if holds_sharded(state):  # DTensors, or objects with state_dict(): DCP plans the save
            from .sharded import dcp_calls

            return dcp_calls.save(self.writer, state, request, lambda: self.staging)
        from .files.byteio import tensor_bytes
        from .save.staging import written_bytes

        job = self.writer.prepare(state, request)
        shared = written_bytes(job.plan.mine, lambda: self.staging)  # this rank's share only
        return self.writer.write(job, shared, lambda b: tensor_bytes(b.source))

    def save_async(self, state: object, request: SaveRequest) -> SaveHandle:
        """Copy ``state`` to the staging buffer, then write and commit it in the background."""
        self.saver.wait_previous()
        with collector_paused():
            return self._save_async(state, self._with_parent(request))

    def _save_async(self, state: object, request: SaveRequest) -> SaveHandle:
        if holds_sharded(state):
            from .sharded import dcp_calls

            return dcp_calls.save_async(self.writer, state, request, self.staging, self.saver)
        from .save.distributed import staged_blobs

        job = self.writer.prepare(state, request, defer_claim=True)  # claimed in the background
        blobs, offset = staged_blobs(job.plan)  # only this rank's share and its own state
        staged = self.staging.stage(blobs)
        attempts = 0

        def write() -> VersionInfo:
            nonlocal attempts
            attempts += 1
            if attempts > 1 and not self.writer.group.is_solo:
                raise CheckpointError(
                    f"the save of version {job.version} was made by every rank together and cannot be "
                    "written again by one rank: save again from every rank"
                )
            if attempts > 1:  # a resubmitted save: drop what the failed attempt left
                self.writer.clear_leftovers(job.version)
            # Not paused here: training goes on meanwhile, and its garbage must not wait for a write.
            return self.writer.write(job, lambda b: staged[b.index], lambda b: staged[b.index + offset])

        return self.saver.submit(write, job.version)

    def dcp_writer(self, request: SaveRequest) -> DcpWriter:
        """A StorageWriter for one ``dcp.save``/``dcp.async_save`` of the caller's own."""
        from .sharded import dcp_calls

        writer = dcp_calls.new_writer(self.writer, self._with_parent(request), lambda: self.staging)
        with self._lock:
            self._open_writer = writer
        return writer

    def _settle(self) -> int | None:
        """The caller's own ``dcp.save`` tells only the coordinator's writer that it committed: the
        other ranks learn it here, before the parent of their next save or load is set, so that
        every rank's next save starts from (and references the bytes of) that version. Returns
        that version once it committed (the writer is then forgotten); a writer whose save has
        not committed (yet) is kept. Called under ``_lock``."""
        writer = self._open_writer
        if writer is None or writer.number is None or not writer.is_committed():
            return None
        self._open_writer = None
        self.parent = writer.number
        return writer.number

    def loaded(self, version: int) -> None:
        """The store loaded ``version``: the parent of its next save."""
        with self._lock:
            self._settle()
            self.parent = version

    def join_inflight(self) -> None:
        """Wait for the async save in flight, if any, to end (without raising its failure)."""
        inflight = self.saver._inflight
        if inflight is not None:
            inflight.join()

    def write_under(self, lease: StoreLease | None) -> None:
        """Make commits need ``lease``; None: commit without one."""
        with self._lock:
            self._lease = lease
            if self._made_writer is not None:
                self._made_writer.lease = lease

    def write_for(self, pids: frozenset[int]) -> None:
        """Let commits go under a lease one of ``pids`` (of this host) holds."""
        with self._lock:
            self._writes_for = pids
            if self._made_writer is not None:
                self._made_writer.writes_for = pids

    @property
    def lease(self) -> StoreLease | None:
        """The lease this store's commits go under, if it holds one."""
        return self._lease

    @property
    def writes_for(self) -> frozenset[int]:
        """The processes (of this host) under whose lease this store may commit."""
        return self._writes_for

    def close(self) -> None:
        """Wait for the async save in flight and release the staging buffer."""
        try:
            self.saver.wait_previous()
        finally:
            self.saver.shutdown()
            if self._made_staging is not None:
                self._made_staging.release()
