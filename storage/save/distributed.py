"""The ranks of a save: one process is the group of one, every save runs the same phases.

Every save, from one process or from every rank of a torch.distributed job,
plans the same split, agrees on a claimed version number, writes this rank's
share, gathers every rank's report on rank 0, which commits (see
:mod:`.saving`). For one process, :meth:`RankGroup.solo`, the collectives
below are no-ops that hand back this process's own value: the phases, and
every feature built on them, are the same code at every world size.

The replicated state (what DDP keeps identical on every rank: model,
optimizer, scheduler) is split over the ranks by size, and each rank writes
only its share, so W ranks write about 1/W of the bytes each. Each rank also
writes its own state (RNG states, data position) to a small file of its own.
Then every rank reports what it wrote (shard sizes and checksums, blob
entries) to rank 0, which writes the manifest only if every rank succeeded,
and tells every rank the outcome. A failed or dead rank means no manifest:
the previous version stays the latest, and the files written are garbage that
a retry of the same version or ``gc`` removes.

The checkpoint's collectives run on a group of their own (gloo, so they work
beside NCCL on GPUs), so that an async save's background thread never
interleaves with the training loop's collectives on the default group. They
carry JSON in uint8 tensors: nothing a rank receives is unpickled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError, RankFailedError, RankLoadError
from ..format.dtypes import dtype_name
from ..format.manifest import ShardEntry, tensor_doc
from ..format.structure import Leaf, encode
from .planner import (
    SHARD_BYTES,
    Blob,
    SavePlan,
    ShardPlan,
    TensorRef,
    assign_rank_shards,
    plan_blobs,
    plan_chunked_blobs,
    shard_file_name,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the job, and the checkpoint's own process group."""

    rank: int
    world_size: int
    group: Any  # a torch.distributed ProcessGroup (gloo)

    @classmethod
    def create(cls, timeout: timedelta = DEFAULT_TIMEOUT) -> RankGroup:
        """A new gloo group over every rank of the default group (a collective call: all ranks make it)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "a distributed CheckpointStore needs torch.distributed to be initialised: "
                "call torch.distributed.init_process_group(...) on every rank first"
            )
        group = dist.new_group(backend="gloo", timeout=timeout)
        return cls(dist.get_rank(), dist.get_world_size(), group)

    @classmethod
    def solo(cls) -> RankGroup:
        """One process: the group of one, whose collectives hand back this process's own value."""
        return cls(0, 1, None)

    @property
    def is_solo(self) -> bool:
        return self.world_size == 1 and self.group is None

    def broadcast(self, value: Any) -> Any:
        """Rank 0's JSON value, on every rank."""
        if self.is_solo:
            return value
        data = _encode(value) if self.rank == 0 else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        with _collective():
            dist.broadcast(size, src=0, group=self.group)
            if self.rank != 0:
                data = torch.empty(int(size.item()), dtype=torch.uint8)
            if data.numel():
                dist.broadcast(data, src=0, group=self.group)
        return _decode(data)

    def gather(self, value: Any, *, wire: tuple[Callable, Callable] | None = None) -> list[Any] | None:
        """Every rank's value, in rank order, on rank 0 (None on the others). Values cross as JSON:
        ``wire`` gives the functions to and from JSON of a value that is not (unused by one process)."""
        if self.is_solo:
            return [value]
        to_json, from_json = wire or (lambda v: v, lambda v: v)
        with _collective():
            sizes, padded = self._padded(to_json(value))
            if self.rank == 0:
                out = [torch.empty_like(padded) for _ in range(self.world_size)]
                dist.gather(padded, out, dst=0, group=self.group)
                return [from_json(v) for v in _unpadded(out, sizes)]
            dist.gather(padded, None, dst=0, group=self.group)
        return None

    def all_gather(self, value: Any, *, what: str | None = None) -> list[Any]:
        """Every rank's JSON value, in rank order, on every rank (``what``: the work other than a save
        that it is part of, for the error if a rank is gone)."""
        if self.is_solo:
            return [value]
        with _collective(what):
            sizes, padded = self._padded(value)
            out = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(out, padded, group=self.group)
        return _unpadded(out, sizes)

    def _padded(self, value: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every rank's encoded size (a collective), and ``value`` encoded, padded to the longest."""
        data = _encode(value)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=self.group)
        padded = torch.zeros(max(int(n.item()) for n in sizes), dtype=torch.uint8)
        padded[: data.numel()] = data
        return sizes, padded

    def together(self, work: Any, what: str) -> list[Any]:
        """Run ``work()`` on every rank and give every rank all their JSON results, in rank order;
        if it failed anywhere, every rank raises.

        The rank that failed raises its own error; the others raise :class:`RankLoadError`
        with the first failed rank's error in its message.
        """
        if self.is_solo:
            return [work()]
        failure: BaseException | None = None
        try:
            outcome = {"ok": work()}
        except BaseException as exc:  # every rank must hear of it (an interrupt too), or they would wait
            failure = exc
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            outcomes = self.all_gather(outcome, what=what)
        except RankLoadError:
            if failure is not None:  # this rank's own error says more than a peer gone quiet
                raise failure from None
            raise
        if failure is not None:
            raise failure
        for rank, theirs in enumerate(outcomes):
            if "error" in theirs:
                raise RankLoadError(f"{what} failed on rank {rank}: {theirs['error']}")
        return [theirs["ok"] for theirs in outcomes]

    def agree(self, work: Any, what: str) -> Any:
        """Run ``work()`` on rank 0 and give its result (or its failure) to every rank."""
        if self.is_solo:
            return work()
        outcome: dict[str, Any] | None = None
        if self.rank == 0:
            try:
                outcome = {"ok": work()}
            except Exception as exc:  # every rank must hear of it, or they would wait forever
                outcome = {"error": f"{type(exc).__name__}: {exc}"}
                self.broadcast(outcome)
                raise
        outcome = self.broadcast(outcome)
        if "error" in outcome:
            raise RankFailedError(f"{what} failed on rank 0: {outcome['error']}")
        return outcome["ok"]


@contextmanager
def _collective(what: str | None = None) -> Iterator[None]:
    """A collective of the checkpoint group that failed (a rank died, or it timed out): RankFailedError
    in a save, RankLoadError in ``what`` (anything else)."""
    try:
        yield
    except RuntimeError as exc:  # what gloo raises for a peer that closed its connection, or a timeout
        if what is None:
            raise RankFailedError(
                f"a rank of the checkpoint group died or timed out ({exc}); the save did not complete on "
                "every rank and the previous committed version is intact"
            ) from exc
        raise RankLoadError(
            f"a rank of the checkpoint group died or timed out in {what} ({exc}); "
            "it did not complete on every rank"
        ) from exc


def collective_failed(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a torch.distributed collective: a rank died or it timed out.

    gloo raises a plain RuntimeError for a peer that closed its connection, or for a timeout, from
    inside the collective; a RuntimeError of anything else (a library's own check) is not one.
    """
    if isinstance(exc, dist.DistError):
        return True
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == dist.distributed_c10d.__name__:
            return True
        tb = tb.tb_next
    return False


def _encode(value: Any) -> torch.Tensor:
    raw = json.dumps(value, allow_nan=False).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def _unpadded(gathered: list[torch.Tensor], sizes: list[torch.Tensor]) -> list[Any]:
    return [_decode(t[: int(n.item())]) for t, n in zip(gathered, sizes, strict=True)]


def _decode(data: torch.Tensor) -> Any:
    return json.loads(bytes(data.numpy().tobytes()).decode())


@dataclass(frozen=True)
class OwnPlan:
    """A rank's own state (RNG states, data position), planned: its JSON structure and its
    tensors' blobs in one file of its own, ``state-r<rank>.h5``."""

    structure: Any
    plan: SavePlan
    entries: list[dict[str, Any]]

    @classmethod
    def of(cls, rank_state: object, rank: int) -> OwnPlan:
        structure, leaves = encode(rank_state)
        blobs, refs = plan_blobs(leaves)
        one = ShardPlan(0, f"state-r{rank}.h5", [b.index for b in blobs], sum(b.nbytes for b in blobs))
        return cls(structure, SavePlan(blobs, refs, [one]), tensor_entries(leaves, refs))

    def report(self, files: list[ShardEntry], written: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """What the rank tells the one committing, once its file is written."""
        return {
            "shard": files[0].model_dump(mode="json"),
            "blobs": [written[i] for i in range(len(self.plan.blobs))],
            "structure": self.structure,
            "tensors": self.entries,
            "nbytes": self.plan.nbytes,
        }

    @staticmethod
    def part(report: dict[str, Any], shard: int) -> dict[str, Any]:
        """The manifest's entry of a rank's own state (:class:`.RankPart`, as JSON) from its report;
        ``shard``: its file's number."""
        blobs = [{**b, "shard": shard} for b in report["blobs"]]
        return {"structure": report["structure"], "blobs": blobs, "tensors": report["tensors"]}


@dataclass(frozen=True)
class RankPlan:
    """What one rank writes: its share of the replicated blobs and its own state, if any."""

    shared: SavePlan  # all replicated blobs; ``shards`` holds only this rank's share
    own: OwnPlan | None

    @property
    def mine(self) -> list[Blob]:
        """The replicated blobs this rank writes."""
        return [self.shared.blobs[i] for shard in self.shared.shards for i in shard.blobs]


def plan_rank(
    leaves: list[Leaf],
    rank_state: object,
    *,
    shards: int,
    rank: int,
    world_size: int,
    shard_bytes: int = SHARD_BYTES,
    chunk_bytes: int | None = None,
) -> RankPlan:
    """Plan the replicated ``leaves``' blobs (tensors above ``chunk_bytes`` in row chunks), this
    rank's files of them, and its own state's file.

    Every rank computes the same split from the same state, so nothing needs to be exchanged
    before writing. A rank has a file of its own when it passed ``rank_state``, and always in a
    job of several ranks (so that each rank's part of the version can be loaded back).
    """
    blobs, refs, chunks = plan_chunked_blobs(leaves, chunk_bytes)
    own = rank_state is not None or world_size > 1
    files = assign_rank_shards(
        blobs, shards=shards, world_size=world_size, rank=rank, shard_bytes=shard_bytes
    )
    if not files and rank == 0 and not own and world_size == 1:
        files = [ShardPlan(0, shard_file_name(0, 0))]  # a state without tensors still gets one file
    own_plan = OwnPlan.of(rank_state if rank_state is not None else {}, rank) if own else None
    return RankPlan(SavePlan(blobs, refs, files, chunks), own_plan)


def staged_blobs(plan: RankPlan) -> tuple[list[Blob], int]:
    """The blobs this rank must copy before an async save returns: its share and its own state.

    Its own blobs are renumbered after the replicated ones (offset returned) so that one
    staging buffer holds both.
    """
    offset = len(plan.shared.blobs)
    own = plan.own.plan.blobs if plan.own is not None else []
    return plan.mine + [replace(b, index=b.index + offset) for b in own], offset


@dataclass(frozen=True)
class RankReport:
    """What a rank tells rank 0 after writing: its files and the entries of the blobs in them, its
    own state's report, or why it failed. Typed in the process; JSON only between ranks."""

    shards: list[ShardEntry]
    blobs: dict[int, dict[str, Any]]  # manifest entries as JSON (:func:`.blob_doc`)
    own: dict[str, Any] | None
    error: str | None = None

    @classmethod
    def failed(cls, exc: BaseException) -> RankReport:
        return cls([], {}, None, f"{type(exc).__name__}: {exc}")

    def to_json(self) -> dict[str, Any]:
        return {
            "shards": [s.model_dump(mode="json") for s in self.shards],
            "blobs": {str(i): b for i, b in self.blobs.items()},
            "own": self.own,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RankReport:
        return cls(
            [ShardEntry.model_validate(s) for s in raw["shards"]],
            {int(i): b for i, b in raw["blobs"].items()},
            raw["own"],
            raw["error"],
        )


@dataclass(frozen=True)
class Assembled:
    shards: list[ShardEntry]
    blobs: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    own_nbytes: int


def assemble(reports: list[RankReport], blob_count: int) -> Assembled:
    """Rank 0: one shard list and one blob list from every rank's report.

    Each rank numbered its shards from 0; here they are concatenated in rank
    order (a file of another version that several ranks reference listed once)
    and every blob entry's shard number follows its shard.
    """
    shards: list[ShardEntry] = []
    blobs: dict[int, dict[str, Any]] = {}
    ranks: list[dict[str, Any]] = []
    own_nbytes = 0
    listed: dict[tuple[int | None, str], int] = {}  # a file of another version, listed once
    for rep in reports:
        number = []
        for shard in rep.shards:
            place = (shard.version, shard.file)
            if shard.version is None or place not in listed:
                listed[place] = len(shards)
                shards.append(shard)
            number.append(listed[place])
        moved = number != list(range(len(number)))
        for key, entry in rep.blobs.items():
            blobs[key] = {**entry, "shard": number[entry["shard"]]} if moved else entry
        if rep.own is not None:
            shards.append(ShardEntry.model_validate(rep.own["shard"]))
            ranks.append(OwnPlan.part(rep.own, len(shards) - 1))
            own_nbytes += int(rep.own["nbytes"])
    if ranks and len(ranks) != len(reports):
        raise CheckpointError(
            f"{len(ranks)} of {len(reports)} ranks passed rank_state: all or none must; nothing was committed"
        )
    missing = [i for i in range(blob_count) if i not in blobs]
    if missing:  # the ranks did not split the state alike: their states differ
        raise CheckpointError(
            f"no rank wrote {len(missing)} of the {blob_count} replicated tensors: the ranks passed "
            "different replicated states (same keys, shapes and dtypes are required on every rank)"
        )
    return Assembled(shards, [blobs[i] for i in range(blob_count)], ranks, own_nbytes)


def tensor_entries(leaves: list[Leaf], refs: list[TensorRef]) -> list[dict[str, Any]]:
    """The manifest's entries of the planned leaves (JSON: :func:`.tensor_doc`): key path, blob,
    dtype, shape, view."""
    names: dict[torch.dtype, str] = {}
    entries = []
    for leaf, r in zip(leaves, refs, strict=True):
        name = names.get(r.dtype)
        if name is None:
            name = names[r.dtype] = dtype_name(r.dtype)
        stride = list(r.stride) if r.stride is not None else None
        entries.append(tensor_doc(leaf.path, r.blob, name, list(r.shape), stride, r.offset))
    return entries


__all__ = [
    "OwnPlan",
    "RankFailedError",
    "RankGroup",
    "RankPlan",
    "RankReport",
    "assemble",
    "collective_failed",
    "plan_rank",
    "staged_blobs",
]
