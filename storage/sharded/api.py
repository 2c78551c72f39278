"""The store's sharded side: DTensor (FSDP2, tensor-parallel) states, through DCP's planner.

:class:`ShardedStore` is a base class of :class:`~ckptflow.storage.CheckpointStore`:

- ``dcp_writer(epoch=E)`` / ``dcp_reader(version=V)``: the StorageWriter and
  StorageReader for ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``;
- ``save`` of a state that holds a DTensor (or a DCP ``Stateful`` object) goes
  through ``dcp.save`` with that writer, on the store's own gloo group: each rank
  writes the chunks it holds, every replicated chunk once, rank 0 commits;
- ``load(into=state)`` of a state that holds one goes through ``dcp.load``:
  every rank reads the parts of the stored chunks its DTensors cover, whatever
  the world and mesh that saved them.

A sharded version is an ordinary committed version: listed, verified,
archived, uploaded and pruned like any other, and ``load()`` in one process
returns its tensors whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, RankFailedError
from ..info import VersionInfo

if TYPE_CHECKING:
    from ..files.location import Location
    from ..info import StoreOptions
    from ..save.async_save import SaveHandle
    from ..save.distributed import RankGroup
    from ..save.saving import VersionWriter
    from ..save.store_saver import SaveRequest, StoreSaver
    from ..versions import catalog
    from .reader import DcpReader
    from .writer import DcpWriter


class ShardedStore:
    """What :class:`~ckptflow.storage.CheckpointStore` does with sharded (DTensor) state."""

    loc: Location
    options: StoreOptions
    group: RankGroup | None
    _saves: StoreSaver

    if TYPE_CHECKING:

        @property
        def _writer(self) -> VersionWriter: ...

        @property
        def world_size(self) -> int: ...

        def _locate(self, version: int | None) -> catalog.Located: ...

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
        from ..save.store_saver import SaveRequest

        return self._writer_for(SaveRequest(epoch, step, metrics, version, user))

    def _writer_for(self, request: SaveRequest) -> DcpWriter:
        from .writer import DcpWriter

        return DcpWriter(
            self._writer, request, world_size=self.world_size, staging=lambda: self._saves.staging
        )

    def dcp_reader(self, *, version: int | None = None, verify: bool | None = None) -> DcpReader:
        """A StorageReader of a committed version (the newest when ``version`` is None) for ``dcp.load``."""
        return self._reader_of(self._locate(version), verify)

    def _reader_of(self, located: catalog.Located, verify: bool | None) -> DcpReader:
        from .reader import DcpReader

        return DcpReader(self.loc, self.options, located, verify=verify)

    def _save_sharded(self, state: object, request: SaveRequest) -> VersionInfo:
        import torch.distributed.checkpoint as dcp

        self._saves.saver.wait_previous()
        writer = self._writer_for(request)
        _refuse_split_without_group(state, self.group)
        writer.keep_own(request.rank_state)
        with _one_process(self.group), _collector_paused(), self._save_failures(writer):
            dcp.save(
                _as_dict(state),
                storage_writer=writer,
                process_group=self._process_group(),
                no_dist=self.group is None,
            )
        return self._version_committed(writer)

    def _save_sharded_async(self, state: object, request: SaveRequest) -> SaveHandle:
        """Copy this rank's shards to host memory, claim the version, write and commit in the background."""
        import torch.distributed.checkpoint as dcp

        from .staging import copies_ended, stage

        saver = self._saves.saver
        saver.wait_previous()
        _refuse_split_without_group(state, self.group)
        with _collector_paused():
            staged = _as_dict(stage(state, getattr(self, "_sharded_staging", None)))
            own = stage(request.rank_state) if request.rank_state is not None else None
            copies_ended()
        self._sharded_staging = staged  # reused by the next async save, once this one has ended
        writer = self._writer_for(request)
        writer.keep_own(own)
        writer.claimed = self._claim_for(writer)
        group = self._process_group()

        def write() -> VersionInfo:
            writer.reset()
            with self._save_failures(writer):
                dcp.save(staged, storage_writer=writer, process_group=group, no_dist=self.group is None)
            return self._version_committed(writer)

        return saver.submit(write, writer.claimed)

    def _version_committed(self, writer: DcpWriter) -> VersionInfo:
        """The version the writer's rank 0 committed, on every rank."""
        if self.group is None:
            assert writer.info is not None
            return writer.info
        info = dataclasses.asdict(writer.info) if writer.info is not None else None
        return VersionInfo(**self.group.broadcast(info))

    def _claim_for(self, writer: DcpWriter) -> int:
        """The version number, claimed by rank 0 for every rank (a collective in a distributed store)."""
        claim = writer.claim_now
        return int(self.group.agree(claim, "claiming a version") if self.group is not None else claim())

    def _load_sharded(self, version: int | None, into: object, verify: bool | None) -> Any:
        """``dcp.load`` on each rank by itself, then one collective so that all fail if one did.

        DCP's default load plan needs no coordination (its global step returns each rank's plan
        as it is): each rank reads the manifest and plans its own reads, so the plans are not
        gathered and scattered as pickles. ``Stateful`` objects get their state back only once
        every rank has read its part (their ``load_state_dict`` may run collectives of its own).
        """
        import torch.distributed.checkpoint as dcp

        state = _as_dict(into)
        self._saves.join_inflight()  # an async save's collectives use the same group: not beside these
        keys = sorted(state)  # DCP's order, the same on every rank
        plain = {k: state[k].state_dict() if is_stateful(state[k]) else state[k] for k in keys}

        def load_from(found: Callable[[], catalog.Located]) -> None:
            reader = self._reader_of(found(), verify)
            with _no_dist_warning(), _failures_unwrapped("the load"):  # a job of one, to DCP
                dcp.load(plain, storage_reader=reader, planner=reader.fitting_planner(), no_dist=True)

        def put_back() -> None:
            for key in keys:
                if is_stateful(state[key]):
                    state[key].load_state_dict(plain[key])
                else:
                    state[key] = plain[key]

        with _collector_paused():
            if self.group is None:
                load_from(lambda: self._locate(version))
                put_back()
                return into
            mine, newest = self._located_alike(version)
            agreed = (lambda: mine) if mine.version == newest else (lambda: self._locate(newest))
            self.group.together(lambda: load_from(agreed), f"the load of version {newest}")
            if any(is_stateful(state[key]) for key in keys):
                self.group.together(put_back, f"putting version {newest} into the state's objects")
            else:
                put_back()
        return into

    def _located_alike(self, version: int | None) -> tuple[catalog.Located, int]:
        """What this rank found, and the version every rank of the group loads: each rank looks
        at the same time. With none named, a save that commits while they look can make the
        ranks see different newest versions: they all take the highest one seen, which is
        committed."""
        assert self.group is not None
        mine: list[catalog.Located] = []

        def find() -> int:
            mine.append(self._locate(version))
            return mine[0].version

        newest = max(self.group.together(find, "finding the version to load"))
        return mine[0], newest

    @contextlib.contextmanager
    def _save_failures(self, writer: DcpWriter) -> Iterator[None]:
        """A failed save: rank 0 removes its partial files once no rank writes any more, and every
        rank raises an error a user can act on, not DCP's wrapper nor gloo's bare RuntimeError.

        DCP raises its CheckpointException only after gathering every rank's outcome, so every rank
        has stopped writing then. A collective that failed (a rank died, or it timed out) says
        nothing of the other ranks: their files stay, for a retry of the version or ``gc``.
        """
        from torch.distributed.checkpoint.api import CheckpointException

        from ..save.distributed import collective_failed

        rank = self.group.rank if self.group is not None else 0
        try:
            yield
        except CheckpointException as wrapper:
            if rank == 0:
                writer.discard()
            raise _unwrapped(wrapper, rank, "the save") from None
        except RuntimeError as exc:
            if not collective_failed(exc):
                raise
            raise _rank_lost(writer, exc) from exc

    def _process_group(self) -> Any:
        return self.group.group if self.group is not None else None


def holds_sharded(state: object) -> bool:
    """Whether ``state`` holds a DTensor or a DCP ``Stateful`` object (anything DCP must plan).

    Imports nothing: a process that never imported ``torch.distributed.tensor`` has no DTensor,
    and a plain save must not pay for importing torch.distributed.checkpoint (0.7 s here).
    """
    tensor = sys.modules.get("torch.distributed.tensor")
    dtensor = tensor.DTensor if tensor is not None else None
    for value in _values(state, set()):
        if (dtensor is not None and isinstance(value, dtensor)) or is_stateful(value):
            return True
    return False


def is_stateful(value: object) -> bool:
    """What DCP's ``Stateful`` protocol checks: ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _values(state: object, seen: set[int]) -> Iterator[object]:
    """The leaves of ``state``'s dicts, lists and tuples (without recursion: any depth)."""
    stack = [state]
    while stack:
        node = stack.pop()
        if not isinstance(node, (dict, list, tuple)):
            yield node
        elif id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.values() if isinstance(node, dict) else node)


def _refuse_split_without_group(state: object, group: RankGroup | None) -> None:
    """A DTensor split over several ranks is saved by all of them: on a distributed store."""
    from torch.distributed.tensor import DTensor

    if group is not None:
        return
    for value in _values(state, set()):
        if isinstance(value, DTensor) and value.device_mesh.size() > 1:
            raise CheckpointError(
                "the state holds DTensors spread over several ranks: open the store with "
                "CheckpointStore(url, distributed=True) on every rank and save from all of them"
            )


@contextlib.contextmanager
def _one_process(group: RankGroup | None) -> Iterator[None]:
    """Without a group DCP runs in this process alone, and says so each time: not worth a warning."""
    if group is not None:
        yield
        return
    with _no_dist_warning():
        yield


@contextlib.contextmanager
def _no_dist_warning() -> Iterator[None]:
    """DCP run in this process alone (``no_dist``) says so each time: not worth a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for one save or load on the caller's thread.

    DCP's planning and the manifest make thousands of short-lived objects, enough to set off
    full collections that walk everything the process holds (0.15 s each in a process with an
    FSDP2 model, several per load at W=2). Nothing they make is cyclic garbage: reference
    counting frees it, and the collector's counters start again when it is switched back on.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _failures_unwrapped(what: str) -> Iterator[None]:
    """A DCP call of this process alone: its CheckpointException as the error inside it."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as wrapper:
        raise _unwrapped(wrapper, 0, what) from None


def _unwrapped(wrapper: Any, rank: int, what: str) -> BaseException:
    """DCP's CheckpointException (every rank's errors, gathered) as this rank's own error, or as
    RankFailedError naming the rank that failed: the error a user can act on, not DCP's wrapper."""
    failures = wrapper.failures
    if rank in failures:
        return failures[rank][0]
    other = min(failures)
    error = failures[other][0]
    return RankFailedError(f"{what} failed on rank {other}: {type(error).__name__}: {error}")


def _rank_lost(writer: DcpWriter, exc: RuntimeError) -> RankFailedError:
    """A collective of the save failed: a rank died or timed out (gloo's error in ``exc``)."""
    version = writer.number
    save = f"the save of version {version}" if version is not None else "the save"
    if writer.is_committed():
        return RankFailedError(
            f"version {version} was committed, but a rank of the checkpoint group died or timed out "
            f"after it ({exc}); restart every rank of the job to go on"
        )
    return RankFailedError(
        f"a rank of the checkpoint group died or timed out during {save} ({exc}); nothing was "
        "committed and the previous committed version is intact: restart every rank of the job and "
        "save again"
    )


def _as_dict(state: object) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise CheckpointError(f"a sharded state must be a dict (as DCP's), got {type(state).__name__}")
    return state


__all__ = ["ShardedStore", "holds_sharded", "is_stateful"]
