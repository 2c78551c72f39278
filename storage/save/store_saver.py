"""The save side of a store: what a :class:`CheckpointStore` holds in memory to write versions.

A store makes its :class:`VersionWriter` and its staging buffer on the first save (they
import torch; listing, pruning and archiving must not), keeps the one async save in
flight, and hands its writer the lease its commits need. Always: at most one save is in
flight, and every save waits for the previous one (raising its failure, if nobody did).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..files.byteio import tensor_bytes
from ..files.location import Location
from ..info import StoreOptions, VersionInfo
from .async_save import AsyncSaver, SaveHandle

if TYPE_CHECKING:
    from ..versions.lease import StoreLease
    from .distributed import RankGroup
    from .saving import SaveJob, VersionWriter
    from .staging import StagingBuffer


@dataclass(frozen=True)
class SaveRequest:
    """What a save records besides the state: :meth:`CheckpointStore.save`'s keyword arguments."""

    epoch: int | None = None
    step: int | None = None
    metrics: dict[str, float] | None = None
    version: int | None = None
    user: dict[str, Any] | None = None
    rank_state: object = None


class StoreSaver:
    """The writer, the staging buffer and the async save in flight of one store."""

    def __init__(self, loc: Location, options: StoreOptions, group: RankGroup | None) -> None:
        self.loc = loc
        self.options = options
        self.group = group
        self.saver = AsyncSaver()
        self._lock = threading.Lock()
        self._made_writer: VersionWriter | None = None
        self._made_staging: StagingBuffer | None = None
        self._lease: StoreLease | None = None
        self._writes_for: frozenset[int] = frozenset()

    @property
    def writer(self) -> VersionWriter:
        """The save path (made on the first save, with torch)."""
        with self._lock:
            if self._made_writer is None:
                from .saving import VersionWriter

                self._made_writer = VersionWriter(self.loc, self.options, self.group)
                self._made_writer.lease = self._lease
                self._made_writer.writes_for = self._writes_for
            return self._made_writer

    @property
    def staging(self) -> StagingBuffer:
        with self._lock:
            if self._made_staging is None:
                from .staging import StagingBuffer

                self._made_staging = StagingBuffer()
            return self._made_staging

    def prepare(self, state: object, request: SaveRequest) -> SaveJob:
        """Wait for the save in flight (raising its failure), then plan and number this one."""
        self.saver.wait_previous()
        return self.writer.prepare(
            state,
            request.epoch,
            request.step,
            request.metrics,
            request.version,
            request.user,
            request.rank_state,
        )

    def save(self, state: object, request: SaveRequest) -> VersionInfo:
        """Write ``state`` and commit it before returning."""
        job = self.prepare(state, request)
        if job.ranked is not None:  # reads only this rank's share: staging every device blob would waste it
            return self.writer.write_ranked(
                job, lambda b: tensor_bytes(b.source), lambda b: tensor_bytes(b.source)
            )
        from .staging import written_bytes

        return self.writer.write(job, written_bytes(job.plan.blobs, lambda: self.staging))

    def save_async(self, state: object, request: SaveRequest) -> SaveHandle:
        """Copy ``state`` to the staging buffer, then write and commit it in the background."""
        job = self.prepare(state, request)
        if job.ranked is not None:
            return self._submit_ranked(job)
        staged = self.staging.stage(job.plan.blobs)
        attempts = 0

        def write() -> VersionInfo:
            nonlocal attempts
            attempts += 1
            if attempts > 1:  # a resubmitted save: drop what the failed attempt left
                self.writer.clear_leftovers(job.version)
            return self.writer.write(job, lambda b: staged[b.index])

        return self.saver.submit(write, job.version)

    def _submit_ranked(self, job: SaveJob) -> SaveHandle:
        from .distributed import staged_blobs

        assert job.ranked is not None
        blobs, offset = staged_blobs(job.ranked)
        staged = self.staging.stage(blobs)
        attempts = 0

        def write() -> VersionInfo:
            nonlocal attempts
            attempts += 1
            if attempts > 1 and self.group is not None:
                raise CheckpointError(
                    f"the save of version {job.version} was made by every rank together and cannot be "
                    "written again by one rank: save again from every rank"
                )
            if attempts > 1:
                self.writer.clear_leftovers(job.version)
            return self.writer.write_ranked(
                job, lambda b: staged[b.index], lambda b: staged[b.index + offset]
            )

        return self.saver.submit(write, job.version)

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
