"""torch.distributed.checkpoint's StorageWriter over ckptflow's format: DCP plans, ckptflow stores.

``dcp.save(state, storage_writer=store.dcp_writer(epoch=E))`` runs DCP's own
planner (which flattens the state, cuts DTensors into the chunks each rank
holds, and gives every replicated chunk to one rank only) and this writer
stores the result as an ordinary committed version:

These are the phases every save runs (:mod:`..save.saving`), with DCP's
planner and collectives in place of the store's own:

1. ``prepare_global_plan`` (the coordinator, rank 0): claims the version number,
   exclusively, before any rank writes, and hands it to every rank's plan;
2. ``write_data`` (every rank): its chunks as blobs of HDF5 shards named after
   its rank, checksummed as they stream out, except the chunks the parent version
   holds, which it references (:mod:`..save.dedup`: a frozen base is written once);
   its non-tensor values as JSON (what DCP would torch.save is taken from the
   planner's state, never pickled);
3. ``finish`` (the coordinator, after every rank's write succeeded): one
   manifest from DCP's metadata and every rank's results, written last: the
   commit. A rank that failed or died means no manifest, so the previous
   version stays the latest.

A failed save's partial files (every rank's shards, the claim) are removed by
the coordinator only once no rank writes any more: in ``finish`` when the
commit fails, and in :meth:`DcpWriter.discard`, which the store calls after
DCP raised a failure it gathered from every rank. DCP tells a StorageWriter
only of success, so after a failed ``dcp.save`` of the caller's own the files
stay for ``gc``. A rank that died tells no one: the others' files stay too.

DCP's own collectives carry the plans and results between ranks (in memory,
as DCP does); nothing written to the store is a pickle.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from ..errors import CheckpointError, UnsupportedValueError
from ..files.byteio import tensor_bytes
from ..files.location import translate_errors
from ..format.blob import Blob
from ..format.checksum import PIECE_BYTES
from ..format.dtypes import dtype_name
from ..format.manifest import ChunkedEntry, ManifestDraft, ShardEntry
from ..format.names import version_dir
from ..format.structure import decode, encode
from ..info import SaveRequest, VersionInfo
from ..save.distributed import OwnPlan
from ..save.planner import SavePlan as BlobPlan
from ..save.planner import assign_shards, dataset_name, shards_per_rank
from ..save.saving import checked, new_manifest
from ..versions.commit import read_record
from .ids import checkpoint_version
from .layout import chunk_entry, path_text, sharded_structure

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..save.saving import VersionWriter
    from ..save.staging import StagingBuffer

log = logging.getLogger(__name__)


class DcpWriter(StorageWriter):
    """Writes one DCP save as one committed version of a store (make a new one for each save)."""

    def __init__(
        self,
        versions: VersionWriter,
        request: SaveRequest,
        *,
        staging: Callable[[], StagingBuffer],
    ) -> None:
        super().__init__()
        self.versions = versions
        self.staging = staging  # the store's host buffer, for chunks on a device
        self.request = checked(request)  # a bad metric is refused before anything is written
        self.asked = request.version  # the version the caller asked for (a checkpoint_id may name one)
        self.world_size = versions.world_size
        self.version: int | None = None
        self.claimed: int | None = None  # claimed before the save started (an async save)
        self.info: VersionInfo | None = None
        self.started = time.perf_counter()
        self.own: OwnPlan | None = None  # this rank's own state (RNGs, data position), if any

    def keep_own(self, rank_state: object) -> None:
        """Write ``rank_state`` (this rank's own, not sharded) beside the chunks, as ``state-r<rank>.h5``;
        planned now, so that a value that cannot be stored is refused before anything is written."""
        self.own = OwnPlan.of(rank_state, self.versions.rank) if rank_state is not None else None

    # -- DCP's calls, in the order it makes them ------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        """A new save; ``checkpoint_id`` (DCP's): the version it writes (:mod:`.ids`)."""
        if checkpoint_id is not None:
            number = checkpoint_version(checkpoint_id, self.versions.loc)
            asked = self.claimed if self.claimed is not None else self.asked
            if asked is not None and asked != number:
                raise CheckpointError(
                    f"checkpoint_id {checkpoint_id!r} names version {number}, but this writer saves "
                    f"version {asked}: give one of them"
                )
            self.request = dataclasses.replace(self.request, version=number)
        self.version, self.info, self.started = None, None, time.perf_counter()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator claims the version for every rank before anything is written."""
        number = self.claimed if self.claimed is not None else self.claim_now()
        self.version = number
        return [
            dataclasses.replace(p, storage_data={"version": number, "rank": r}) for r, p in enumerate(plans)
        ]

    def claim_now(self) -> int:
        """The coordinator: claim the version number (exclusively, before any rank writes)."""
        with translate_errors(self.versions.loc, "saving to"):
            return self.versions.claim(self.request.version, self.request.epoch)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        """This rank's chunks as HDF5 shards, its non-tensor values as JSON results."""
        from ..save.staging import written_bytes

        version, rank = int(plan.storage_data["version"]), int(plan.storage_data["rank"])
        self.version = version
        results: list[WriteResult] = []
        blobs: list[Blob] = []
        names: set[str] = set()
        items = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                results.append(_value_result(item, planner))
                continue
            tensor = planner.resolve_data(item)
            assert isinstance(tensor, torch.Tensor)
            tensor = tensor.detach()
            offsets = item.index.offset or ()
            name = dataset_name(item.index.fqn + "@" + ",".join(map(str, offsets)), names)
            blobs.append(Blob(len(blobs), name, tensor.dtype, tuple(tensor.shape), tensor))
            items.append(item)
        blob_bytes = written_bytes(blobs, self.staging)
        options = self.versions.options
        files_here = shards_per_rank(options.shards, self.world_size)[rank]
        shards = assign_shards(blobs, shards=files_here, rank=rank, shard_bytes=options.shard_bytes)
        blob_plan = BlobPlan(blobs, [], shards if blobs else [])
        with translate_errors(self.versions.loc, "saving to"):
            if rank == 0:
                self.versions.ensure_claim(version)
            parent = self.request.lineage.parent if self.request.lineage else None
            files, written = self.versions.write_share(
                version, blob_plan, blob_bytes, parent, rank=rank, piece_bytes=PIECE_BYTES
            )
        if self.own is not None:
            results.append(self._write_own(self.own, version, rank))
        file_docs = [f.model_dump(mode="json") for f in files]
        for blob, item in zip(blobs, items, strict=True):
            entry = written[blob.index]
            data = {"blob": entry, "file": file_docs[entry["shard"]]}
            results.append(WriteResult(index=item.index, size_in_bytes=blob.nbytes, storage_data=data))
        future: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator commits: the manifest, from DCP's metadata and every rank's results."""
        assert self.version is not None
        try:
            manifest = self._manifest(metadata, [r for rank in results for r in rank])
            manifest.manifest(self.versions.loc.display(version_dir(self.version)))  # as a reader would
            with translate_errors(self.versions.loc, "saving to"):
                self.versions.commit(manifest)
        except BaseException:
            self.versions.discard(self.version)
            raise
        vdir = version_dir(self.version)
        self.info = VersionInfo.from_manifest(manifest, self.versions.loc.display(vdir))
        log.info("committed %s (%d ranks, sharded)", self.info.url, self.world_size)

    def _write_own(self, own: OwnPlan, version: int, rank: int) -> WriteResult:
        """This rank's own state, in its file ``state-r<rank>.h5``, as a write result of its own."""
        with translate_errors(self.versions.loc, "saving to"):
            report = self.versions.write_own(version, own, lambda b: tensor_bytes(b.source), rank=rank)
        data = {"rank": rank, **report}
        return WriteResult(
            index=MetadataIndex(f"{OWN_KEY}{rank}"), size_in_bytes=own.plan.nbytes, storage_data=data
        )

    # -- after a failed save -------------------------------------------------------

    @property
    def number(self) -> int | None:
        """The version this save writes, once known (claimed, or planned)."""
        return self.version if self.version is not None else self.claimed

    def discard(self) -> None:
        """The coordinator, after a failed save that no rank writes any more: remove its partial
        files and its claim, so that a full disk is freed at once."""
        if self.number is not None:
            self.versions.discard(self.number)

    def is_committed(self) -> bool:
        """Whether this save's version is committed (asked after a rank was lost: rank 0 may have
        committed just before)."""
        if self.info is not None:
            return True
        if self.number is None:
            return False
        try:
            record = read_record(self.versions.loc, self.number)
        except Exception:  # the store cannot tell now: say what is known
            return False
        return record is not None and record.is_committed()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.versions.loc.display())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # made by CheckpointStore.dcp_writer, never from a bare id

    # -- the manifest ------------------------------------------------------------

    def _manifest(self, metadata: Metadata, results: list[WriteResult]) -> ManifestDraft:
        files: dict[tuple[int, str], ShardEntry] = {}  # by (version, file): a file may be another version's
        found: dict[MetadataIndex, Any] = {}
        owns: dict[int, Any] = {}
        for result in results:
            if result.index.fqn.startswith(OWN_KEY):
                owns[int(result.storage_data["rank"])] = result.storage_data
                continue
            found[result.index] = result.storage_data
            if "file" in result.storage_data:
                place = _place(result.storage_data["file"])
                if place not in files:
                    files[place] = ShardEntry.model_validate(result.storage_data["file"])
        # This version's own files first, by rank; then the referenced ones, by version.
        order = sorted(files, key=lambda place: (place[0] >= 0, place[0], files[place].rank, place[1]))
        shards = [files[place] for place in order]
        number = {place: i for i, place in enumerate(order)}
        blobs: list[dict[str, Any]] = []
        tensors: dict[str, ChunkedEntry] = {}
        values: dict[str, Any] = {}
        mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                values[fqn] = decode(_lookup(found, fqn, None)["value"], _no_tensor)
                continue
            chunks = []
            for chunk in md.chunks:
                data = _lookup(found, fqn, chunk.offsets)
                blobs.append({**data["blob"], "shard": number[_place(data["file"])]})
                chunks.append(chunk_entry(chunk.offsets, chunk.sizes, len(blobs) - 1))
            path = path_text(tuple(mappings.get(fqn, (fqn,))))
            tensors[fqn] = ChunkedEntry(
                path=path,
                dtype=dtype_name(md.properties.dtype),
                shape=list(md.size),
                requires_grad=bool(md.properties.requires_grad),
                chunks=chunks,
            )
        ranks = []
        if owns:
            if sorted(owns) != list(range(self.world_size)):
                raise CheckpointError(
                    f"ranks {sorted(owns)} of {self.world_size} passed rank_state: all or none must"
                )
            for rank in range(self.world_size):
                shards.append(ShardEntry.model_validate(owns[rank]["shard"]))
                ranks.append(OwnPlan.part(owns[rank], len(shards) - 1))
        structure = sharded_structure(values, tensors, mappings)
        assert self.version is not None
        return new_manifest(
            self.request,
            self.version,
            structure=structure,
            shards=shards,
            blobs=blobs,
            tensors=[],
            nbytes=sum(b["nbytes"] for b in blobs) + sum(int(o["nbytes"]) for o in owns.values()),
            seconds=time.perf_counter() - self.started,
            world_size=self.world_size,
            chunked=[entry.model_dump(mode="json") for entry in tensors.values()],
            ranks=ranks,
        )


OWN_KEY = "ckptflow.rank_state/"  # the write results of the ranks' own states (no DCP item has it)


def _value_result(item: Any, planner: SavePlanner) -> WriteResult:
    """A non-tensor value as JSON (DCP would hand it over torch.save'd: it is taken from the state)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise CheckpointError(
            f"the save planner {type(planner).__name__} has no lookup_object(): ckptflow stores non-tensor "
            "values as JSON, never as torch.save bytes; use DefaultSavePlanner or a subclass of it"
        )
    structure, leaves = encode(lookup(item.index))
    if leaves:
        raise UnsupportedValueError(
            f"{item.index.fqn}/{leaves[0].path}", "a tensor inside a non-tensor value"
        )
    return WriteResult(index=item.index, size_in_bytes=0, storage_data={"value": structure})


def _place(file: dict[str, Any]) -> tuple[int, str]:
    """Where a shard file (its entry, as JSON) is: its version (-1: the version being saved), its name."""
    version = file.get("version")
    return (-1 if version is None else int(version), file["file"])


def _lookup(found: dict[MetadataIndex, Any], fqn: str, offsets: Any) -> Any:
    key = MetadataIndex(fqn, offsets)
    if key not in found:
        raise CheckpointError(f"no rank wrote {fqn!r} at {list(offsets or ())}: nothing was committed")
    return found[key]


def _no_tensor(index: int, is_numpy: bool) -> object:
    raise AssertionError("a value's JSON holds no tensor")


__all__ = ["DcpWriter"]
