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

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import CheckpointError, RankFailedError
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
    "RankPlan",
    "RankReport",
    "assemble",
    "plan_rank",
    "staged_blobs",
]
