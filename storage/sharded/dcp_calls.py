"""Sharded state (FSDP2, tensor-parallel DTensors) saved and loaded through DCP's planner.

A store sends here the saves and loads of states that hold a DTensor or a DCP
``Stateful`` object (:mod:`.kinds`):

- a save goes through ``dcp.save`` with a :class:`~.writer.DcpWriter`, on the
  store's own gloo group (or in this process alone, the group of one): each rank
  writes the chunks it holds, every replicated chunk once, and rank 0 commits
  through the same phases as every other save (:mod:`..save.saving`); an async
  save first copies this rank's shards to the store's one staging buffer;
- a load (``load(into=state)``) goes through ``dcp.load``: every rank reads the
  parts of the stored chunks its DTensors cover, whatever the world and mesh that
  saved them.

A sharded version is an ordinary committed version: listed, verified,
archived, uploaded and pruned like any other, and ``load()`` in one process
returns its tensors whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, RankFailedError
from ..info import SaveRequest, StoreOptions, VersionInfo
from ..save.kinds import is_stateful, leaves

if TYPE_CHECKING:
    from ..files.location import Location
    from ..save.async_save import AsyncSaver, SaveHandle
    from ..save.group import RankGroup
    from ..save.saving import VersionWriter
    from ..save.staging import StagingBuffer
    from ..versions import catalog
    from .reader import DcpReader
    from .writer import DcpWriter


def new_writer(
    versions: VersionWriter, request: SaveRequest, staging: Callable[[], StagingBuffer]
) -> DcpWriter:
    """A StorageWriter for one ``dcp.save``/``dcp.async_save``: it becomes a committed version."""
    from .writer import DcpWriter

    return DcpWriter(versions, request, staging=staging)


def new_reader(
    loc: Location, options: StoreOptions, located: catalog.Located, verify: bool | None
) -> DcpReader:
    """A StorageReader of a committed version for ``dcp.load``."""
    from .reader import DcpReader

    return DcpReader(loc, options, located, verify=verify)


def save(
    versions: VersionWriter, state: object, request: SaveRequest, staging: Callable[[], StagingBuffer]
) -> VersionInfo:
    """Save ``state`` through ``dcp.save``; every rank returns the committed version."""
    import torch.distributed.checkpoint as dcp

    group = versions.group
    writer = new_writer(versions, request, staging)
    _refuse_split_without_group(state, group)
    writer.keep_own(request.rank_state)
    with _one_process(group), _collector_paused(), _save_failures(writer):
        dcp.save(_as_dict(state), storage_writer=writer, process_group=group.group, no_dist=group.is_solo)
    return _version_committed(writer)


def save_async(
    versions: VersionWriter,
    state: object,
    request: SaveRequest,
    staging: StagingBuffer,
    saver: AsyncSaver,
) -> SaveHandle:
    """Copy this rank's shards to ``staging``, claim the version, write and commit in the background."""
    import torch.distributed.checkpoint as dcp

    from ..save.staging import stage_state

    group = versions.group
    _refuse_split_without_group(state, group)
    with _collector_paused():
        copies = stage_state(staging, (_as_dict(state), request.rank_state))
    assert isinstance(copies, tuple)
    staged: dict[str, Any] = copies[0]
    own: object = copies[1]
    writer = new_writer(versions, request, lambda: staging)
    writer.keep_own(own)
    writer.claimed = int(group.agree(writer.claim_now, "claiming a version"))

    def write() -> VersionInfo:
        writer.reset()
        with _save_failures(writer):
            dcp.save(staged, storage_writer=writer, process_group=group.group, no_dist=group.is_solo)
        return _version_committed(writer)

    return saver.submit(write, writer.claimed)


def _version_committed(writer: DcpWriter) -> VersionInfo:
    """The version the writer's rank 0 committed, on every rank."""
    info = dataclasses.asdict(writer.info) if writer.info is not None else None
    return VersionInfo(**writer.versions.group.broadcast(info))


def load(
    loc: Location,
    options: StoreOptions,
    group: RankGroup,
    locate: Callable[[int | None], catalog.Located],
    version: int | None,
    into: object,
    verify: bool | None,
) -> Any:
    """``dcp.load`` on each rank by itself, then one collective so that all fail if one did.

    DCP's default load plan needs no coordination (its global step returns each rank's plan
    as it is): each rank reads the manifest and plans its own reads, so the plans are not
    gathered and scattered as pickles. ``Stateful`` objects get their state back only once
    every rank has read its part (their ``load_state_dict`` may run collectives of its own).
    The caller waits for an async save in flight first: its collectives use the same group.
    """
    import torch.distributed.checkpoint as dcp

    state = _as_dict(into)
    keys = sorted(state)  # DCP's order, the same on every rank
    plain = {k: state[k].state_dict() if is_stateful(state[k]) else state[k] for k in keys}

    def load_from(found: Callable[[], catalog.Located]) -> None:
        reader = new_reader(loc, options, found(), verify)
        with _no_dist_warning(), _failures_unwrapped("the load"):  # a job of one, to DCP
            dcp.load(plain, storage_reader=reader, planner=reader.fitting_planner(), no_dist=True)

    def put_back() -> None:
        for key in keys:
            if is_stateful(state[key]):
                state[key].load_state_dict(plain[key])
            else:
                state[key] = plain[key]

    with _collector_paused():
        if group.is_solo:
            load_from(lambda: locate(version))
            put_back()
            return into
        mine, newest = _located_alike(group, locate, version)
        agreed = (lambda: mine) if mine.version == newest else (lambda: locate(newest))
        group.together(lambda: load_from(agreed), f"the load of version {newest}")
        if any(is_stateful(state[key]) for key in keys):
            group.together(put_back, f"putting version {newest} into the state's objects")
        else:
            put_back()
    return into


def _located_alike(
    group: RankGroup, locate: Callable[[int | None], catalog.Located], version: int | None
) -> tuple[catalog.Located, int]:
    """What this rank found, and the version every rank of the group loads: each rank looks
    at the same time. With none named, a save that commits while they look can make the
    ranks see different newest versions: they all take the highest one seen, which is
    committed."""
    mine: list[catalog.Located] = []

    def find() -> int:
        mine.append(locate(version))
        return mine[0].version

    newest = max(group.together(find, "finding the version to load"))
    return mine[0], newest


@contextlib.contextmanager
def _save_failures(writer: DcpWriter) -> Iterator[None]:
    """A failed save: rank 0 removes its partial files once no rank writes any more, and every
    rank raises an error a user can act on, not DCP's wrapper nor gloo's bare RuntimeError.

    DCP raises its CheckpointException only after gathering every rank's outcome, so every rank
    has stopped writing then. A collective that failed (a rank died, or it timed out) says
    nothing of the other ranks: their files stay, for a retry of the version or ``gc``.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    from ..save.group import collective_failed

    rank = writer.versions.rank
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


def _refuse_split_without_group(state: object, group: RankGroup) -> None:
    """A DTensor split over several ranks is saved by all of them: on a distributed store."""
    from torch.distributed.tensor import DTensor

    if not group.is_solo:
        return
    for value in leaves(state):
        if isinstance(value, DTensor) and value.device_mesh.size() > 1:
            raise CheckpointError(
                "the state holds DTensors spread over several ranks: open the store with "
                "CheckpointStore(url, distributed=True) on every rank and save from all of them"
            )


@contextlib.contextmanager
def _one_process(group: RankGroup) -> Iterator[None]:
    """Without a group DCP runs in this process alone, and says so each time: not worth a warning."""
    if not group.is_solo:
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


__all__ = ["load", "new_reader", "new_writer", "save", "save_async"]
