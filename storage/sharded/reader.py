"""torch.distributed.checkpoint's StorageReader over ckptflow's format: any version, any world.

``dcp.load(state, storage_reader=store.dcp_reader())`` fills the tensors of
``state`` (DTensors of any mesh and placements, plain tensors) from a
committed version, whether ``dcp.save`` or :meth:`CheckpointStore.save`
wrote it and whatever the world that saved it: DCP's planner intersects the
boxes each rank needs with the boxes stored (see :mod:`.layout`), and this
reader reads what it is asked for, in batches of at most ``BATCH_BYTES``: a
stored chunk that a target takes whole straight into the target, verified
against the chunk's checksum; part of a chunk (a load at another world size)
as the rows it needs, out to the edges of the chunk's 1 MiB pieces, each
verified against its own checksum, then copied into place. Into GPU tensors,
whole chunks land in pinned host memory, in batches of ``gpu.BATCH_BYTES``,
and each batch's copies to the GPU run while the next batch is read (see
:mod:`..load.gpu`).

Non-tensor values come from the manifest's JSON. DCP's default load planner
would ``torch.load`` them from bytes (unpickling); this reader puts the value
in place itself instead, as that planner would. A planner with its own
``load_bytes`` gets the value as torch.save'd bytes of the JSON value: only
data ckptflow decoded from JSON, never bytes read from the store.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ..errors import CheckpointError, StateMismatchError
from ..files.location import translate_errors
from ..format.dtypes import dtype_from_name
from ..load import gpu
from ..load.loader import as_bytes, build_tensors
from ..load.reader import Span, read_blobs, read_spans
from ..versions import catalog
from .ids import checkpoint_version
from .layout import Flat, Source, flatten

if TYPE_CHECKING:
    from ..files.location import Location
    from ..format.manifest import Manifest
    from ..info import StoreOptions
    from ..versions.catalog import Located

BATCH_BYTES = 1 << 30  # blobs read at once, at most (one blob larger than this is read alone)
Pair = tuple[ReadItem, torch.Tensor]  # a read item and the tensor its planner resolved it to


class DcpReader(StorageReader):
    """Reads one committed version of a store for ``dcp.load``."""

    def __init__(
        self, loc: Location, options: StoreOptions, located: Located, *, verify: bool | None = None
    ) -> None:
        super().__init__()
        self.loc, self.options, self.located = loc, options, located
        self.manifest: Manifest = located.manifest
        self.verify = options.verify_on_load if verify is None else verify
        self._flat: Flat | None = None
        self._sources: dict[MetadataIndex, Source] = {}

    @property
    def version(self) -> int:
        return self.manifest.version

    def fitting_planner(self) -> LoadPlanner:
        """DCP's default load planner, refusing a state that does not fit this version (a key the
        version lacks, a tensor it stores in another shape) with StateMismatchError naming both."""
        return _FittingPlanner(self.version, self.loc.display())

    # -- DCP's calls --------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        """``checkpoint_id`` (DCP's): read that version of the store instead (:mod:`.ids`)."""
        if checkpoint_id is None:
            return
        number = checkpoint_version(checkpoint_id, self.loc)
        if number != self.version:
            with translate_errors(self.loc, "reading"):
                located = catalog.find(self.loc, number)
            self.located, self.manifest = located, located.manifest
            self._flat, self._sources = None, {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        flat = self._flatten()
        entries: dict[str, Any] = {}
        for fqn, (dtype, shape, boxes) in flat.tensors.items():
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in boxes]
            entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)
        for fqn in flat.values:
            entries[fqn] = BytesStorageMetadata()
        storage = StorageMeta(checkpoint_id=self.loc.display(), load_id=str(self.version))
        return Metadata(entries, planner_data=dict(flat.mappings), storage_meta=storage)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._flatten()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        flat = self._flatten()
        tensor_items = [item for item in plan.items if item.type != LoadItemType.BYTE_IO]
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                self._put_value(item, planner, flat)
        targets = [planner.resolve_tensor(item).detach() for item in tensor_items]
        gpus = {t.device for t in targets if t.is_cuda}
        pairs = list(zip(tensor_items, targets, strict=True))
        for batch in self._batches(pairs, gpu.BATCH_BYTES if gpus else BATCH_BYTES):
            self._read_batch(batch, planner)
        if gpus:
            gpu.copies_ended(gpus)
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # made by CheckpointStore.dcp_reader, never from a bare id

    # -- reading --------------------------------------------------------------------

    def _flatten(self) -> Flat:
        if self._flat is None:
            self._flat = flatten(self.manifest)
            for fqn, (_, _, boxes) in self._flat.tensors.items():
                for offsets, _, source in boxes:
                    self._sources[MetadataIndex(fqn, offsets)] = source
        return self._flat

    def _source(self, item: ReadItem) -> Source:
        key = MetadataIndex(item.storage_index.fqn, item.storage_index.offset)
        if key not in self._sources:
            raise CheckpointError(
                f"version {self.version} has no chunk of {key.fqn!r} at {list(key.offset or ())}"
            )
        return self._sources[key]

    def _blob_of(self, source: Source) -> int:
        if source.blob is not None:
            return source.blob
        assert source.tensor is not None
        return self.manifest.tensors[source.tensor].blob

    def _batches(self, pairs: list[Pair], limit: int) -> list[list[Pair]]:
        """(item, target) pairs grouped so that each group's blobs add up to at most ``limit`` bytes."""
        by_blob: dict[int, list[Pair]] = {}
        for pair in pairs:
            by_blob.setdefault(self._blob_of(self._source(pair[0])), []).append(pair)
        sizes = {blob: self.manifest.blobs[blob].nbytes for blob in sorted(by_blob)}
        return [[i for blob in group for i in by_blob[blob]] for group in gpu.batches(sizes, limit)]

    def _read_batch(self, pairs: list[Pair], planner: LoadPlanner) -> None:
        """Read what the batch's items need, then put each item's part into place.

        A chunk that one item takes whole, into a contiguous CPU tensor of its dtype (the same
        layout saved and loaded), is read straight into that tensor: no second buffer, no copy.
        An item that needs part of a chunk (a load at another world size) reads the rows it
        needs, out to the edges of the chunk's checksummed pieces: whole rows of a contiguous
        target straight into it, anything else into a buffer and copied. A tensor saved by
        ``store.save`` (not chunked) is read whole.
        """
        items = [item for item, _ in pairs]
        targets = [target for _, target in pairs]
        sources = [self._source(item) for item in items]
        direct = self._direct(items, sources, targets)
        landing = _landing({blob: targets[i] for blob, i in direct.items()})
        filled = set(direct.values())
        spans = {
            i: self._span(item, source)
            for i, (item, source) in enumerate(zip(items, sources, strict=True))
            if i not in filled and source.blob is not None
        }
        whole_blobs = sorted({self._blob_of(s) for s in sources if s.tensor is not None} | set(direct))
        with translate_errors(self.loc, "loading from"):
            raw = read_blobs(
                self.loc,
                self.located.sources(self.loc),
                self.manifest,
                whole_blobs,
                verify=self.verify,
                threads=self.options.threads,
                buffers=landing,
            )
            for blob, i in direct.items():  # GPU targets: from pinned memory, not waited for
                if targets[i].device.type != "cpu":
                    targets[i].copy_(
                        landing[blob].view(targets[i].dtype).view(targets[i].shape), non_blocking=True
                    )
            order = list(spans)
            straight = {
                n: i for n, i in enumerate(order) if self._rows_fill(items[i], sources[i], targets[i])
            }
            parts = dict(
                zip(
                    order,
                    read_spans(
                        self.loc,
                        self.located.sources(self.loc),
                        self.manifest,
                        [spans[i] for i in order],
                        verify=self.verify,
                        threads=self.options.threads,
                        into={n: as_bytes(targets[i]) for n, i in straight.items()},
                    ),
                    strict=True,
                )
            )
        filled |= set(straight.values())
        plain = sorted({s.tensor for s in sources if s.tensor is not None})
        whole = build_tensors(self.manifest, raw, plain, torch.device("cpu"), {}) if plain else {}
        for i, (item, source, target) in enumerate(zip(items, sources, targets, strict=True)):
            if i not in filled:
                if source.tensor is not None:
                    stored, first = whole[source.tensor], 0
                else:
                    stored, first = self._rows(source, item, parts[i]), 1
                for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    if dim >= first:
                        stored = stored.narrow(dim, start, length)
                if target.shape != stored.shape:
                    raise CheckpointError(
                        f"{item.dest_index.fqn}: the planner's target is {list(target.shape)}, the stored "
                        f"part {list(stored.shape)}"
                    )
                target.copy_(stored)
            planner.commit_tensor(item, target)

    def _span(self, item: ReadItem, source: Source) -> Span:
        """The bytes of the item's chunk that hold the rows (dim 0) the item needs."""
        assert source.blob is not None
        blob = self.manifest.blobs[source.blob]
        if not blob.shape:
            return Span(source.blob, 0, blob.nbytes)
        row = blob.nbytes // blob.shape[0] if blob.shape[0] else 0
        first, count = item.storage_offsets[0], item.lengths[0]
        return Span(source.blob, first * row, (first + count) * row)

    def _rows_fill(self, item: ReadItem, source: Source, target: torch.Tensor) -> bool:
        """Whether the item's rows are all of its target, laid out as stored: whole rows (no
        narrowing past dim 0) into a contiguous CPU tensor of the chunk's dtype."""
        assert source.blob is not None
        blob = self.manifest.blobs[source.blob]
        return bool(
            blob.shape
            and not any(item.storage_offsets[1:])
            and list(item.lengths[1:]) == blob.shape[1:]
            and _takes_bytes(target, blob.dtype, [item.lengths[0], *blob.shape[1:]])
        )

    def _rows(self, source: Source, item: ReadItem, data: torch.Tensor) -> torch.Tensor:
        """The rows ``_span`` read, as a tensor of the chunk's dtype (all of its other dims)."""
        assert source.blob is not None
        blob = self.manifest.blobs[source.blob]
        values = data.view(dtype_from_name(blob.dtype))
        return values.reshape([item.lengths[0], *blob.shape[1:]] if blob.shape else [])

    def _direct(
        self, items: list[ReadItem], sources: list[Source], targets: list[torch.Tensor]
    ) -> dict[int, int]:
        """Blob -> the item whose target takes the whole chunk as it is stored."""
        users: dict[int, int] = {}
        for source in sources:
            if source.blob is not None:
                users[source.blob] = users.get(source.blob, 0) + 1
        direct: dict[int, int] = {}
        for i, (item, source, target) in enumerate(zip(items, sources, targets, strict=True)):
            if source.blob is None or users[source.blob] != 1:
                continue
            blob = self.manifest.blobs[source.blob]
            whole = not any(item.storage_offsets) and list(item.lengths) == blob.shape
            on_gpu = (
                target.is_cuda
                and blob.nbytes <= gpu.BATCH_BYTES  # larger: through a buffer of its own
                and (target.dtype, list(target.shape)) == (dtype_from_name(blob.dtype), blob.shape)
            )
            if whole and (on_gpu or _takes_bytes(target, blob.dtype, blob.shape)):
                direct[source.blob] = i
        return direct

    def _put_value(self, item: ReadItem, planner: LoadPlanner, flat: Flat) -> None:
        fqn = item.storage_index.fqn
        value = flat.values[fqn]
        if isinstance(value, Source):  # a numpy array stored as a tensor
            assert value.tensor is not None
            blob = self.manifest.tensors[value.tensor].blob
            with translate_errors(self.loc, "loading from"):
                raw = read_blobs(
                    self.loc,
                    self.located.sources(self.loc),
                    self.manifest,
                    [blob],
                    verify=self.verify,
                    threads=1,
                )
            value = build_tensors(self.manifest, raw, [value.tensor], torch.device("cpu"), {})[
                value.tensor
            ].numpy()
        if (
            isinstance(planner, DefaultLoadPlanner)
            and type(planner).load_bytes is DefaultLoadPlanner.load_bytes
        ):
            _set_like_default(planner, item, value)
            return
        data = io.BytesIO()
        torch.save(value, data)
        data.seek(0)
        planner.load_bytes(item, data)


def _landing(targets: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Blob -> where its bytes are read: a CPU target's own memory; for GPU targets, regions of
    one pinned host block (their copies to the GPU are issued once the batch is read)."""
    out = gpu.landing({b: t.numel() * t.element_size() for b, t in targets.items() if t.is_cuda})
    out.update({blob: as_bytes(t) for blob, t in targets.items() if not t.is_cuda})
    return out


def _takes_bytes(target: torch.Tensor, dtype: str, shape: list[int]) -> bool:
    """Whether stored bytes of ``dtype`` and ``shape`` can be read straight into ``target``."""
    return bool(
        target.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == dtype_from_name(dtype)
        and list(target.shape) == shape
    )


def _set_like_default(planner: DefaultLoadPlanner, item: ReadItem, value: Any) -> None:
    """What DefaultLoadPlanner.load_bytes does with the value it unpickles, without unpickling."""
    fqn = item.dest_index.fqn
    if planner.flatten_state_dict:
        node: Any = planner.original_state_dict
        path = planner.mappings[fqn]
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    else:
        planner.state_dict[fqn] = value


class _FittingPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing first a state that does not fit the version."""

    def __init__(self, version: int, where: str) -> None:
        super().__init__()
        self.version, self.where = version, where

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata if self.metadata is not None else {}
        missing = [fqn for fqn in self.state_dict if fqn not in stored]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise self._refused(f"it has no {missing[0]!r}{more}, which the state holds")
        for fqn, value in self.state_dict.items():
            entry = stored[fqn]
            if not (isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata)):
                continue
            if list(value.size()) != list(entry.size):
                raise self._refused(
                    f"{fqn!r} is {list(entry.size)} in it and {list(value.size())} in the state"
                )
        return super().create_local_plan()  # its other errors (a mesh's, memory) stay its own

    def _refused(self, problem: str) -> StateMismatchError:
        return StateMismatchError(
            f"version {self.version} of {self.where} does not fit the state to fill: {problem}; build "
            f"the model and optimizer as they were when it was saved (load({self.version}) without "
            "into= returns what it holds)"
        )


__all__ = ["DcpReader"]
