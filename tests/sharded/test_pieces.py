"""A load that needs part of a stored chunk (a load at another world size) reads the rows it needs,
out to the edges of the chunk's checksummed pieces, and verifies just those pieces.

One process, no process group: ``dcp.save`` through ``store.dcp_writer`` stores a 16 MiB tensor as
one chunk of sixteen 1 MiB pieces, and DCP's own ``DefaultLoadPlanner`` asks the reader for rows
300..324 (bytes 2.3-2.5 MiB: piece 2), as it would for a rank whose shard holds those rows. A
smaller chunk has smaller pieces, so that a partial read rounds out by less.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ckptflow.storage import CheckpointStore, CorruptShardError
from ckptflow.storage.format.checksum import PIECE_BYTES

ROWS, COLS = 2048, 2048  # float32: 16 MiB, 16 pieces of 1 MiB
FIRST, COUNT = 300, 25  # bytes 2,457,600..2,662,400: inside piece 2


@pytest.fixture
def saved(tmp_path: Path) -> tuple[CheckpointStore, torch.Tensor, Path]:
    weights = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))
    store = CheckpointStore(tmp_path / "store")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"w": weights}, storage_writer=store.dcp_writer(epoch=1), no_dist=True)
    manifest = store.manifest()
    (blob,) = manifest.blobs
    assert blob.piece_bytes == PIECE_BYTES == 1 << 20 and len(blob.pieces or []) == 16
    return store, weights, tmp_path / "store" / "v000001" / manifest.shards[blob.shard].file


def read_rows(
    store: CheckpointStore,
    verify: bool = True,
    cols: tuple[int, int] = (0, COLS),
    rows: tuple[int, int] = (FIRST, COUNT),
) -> torch.Tensor:
    """Rows ``rows`` (first, count) of ``w`` and its columns ``cols`` (first, count), through the
    reader, as DCP's planner asks for them. Whole rows land straight in their target; a block of
    columns (a tensor-parallel shard's) goes through a buffer."""
    reader = store.dcp_reader(verify=verify)
    target = torch.zeros(rows[1], cols[1])
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"w": target}, reader.read_metadata(), True)
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w", torch.Size([0, 0])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("w", torch.Size([0, 0])),
        storage_offsets=torch.Size([rows[0], cols[0]]),
        lengths=torch.Size([rows[1], cols[1]]),
    )
    reader.read_data(LoadPlan([item]), planner).wait()
    return target


def damage(shard: Path, store: CheckpointStore, at: list[int]) -> None:
    """Flip a byte of ``w`` at each of the positions ``at`` (bytes into the tensor)."""
    (blob,) = store.manifest().blobs
    assert blob.offset is not None
    data = bytearray(shard.read_bytes())
    for position in at:
        data[blob.offset + position] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("cols", [(0, COLS), (512, 512)], ids=["whole rows", "a block of columns"])
def test_part_of_a_chunk_verifies_only_the_pieces_it_reads(
    saved: tuple[CheckpointStore, torch.Tensor, Path], cols: tuple[int, int]
) -> None:
    store, weights, shard = saved
    expected = weights[FIRST : FIRST + COUNT, cols[0] : cols[0] + cols[1]]
    assert torch.equal(read_rows(store, cols=cols), expected)
    damage(shard, store, [1000, PIECE_BYTES + 1000, 3 * PIECE_BYTES + 1000])  # pieces 0, 1, 3
    assert torch.equal(read_rows(store, cols=cols), expected)
    with pytest.raises(CorruptShardError):  # a whole load still reads and checks every byte
        store.load()
    with pytest.raises(CorruptShardError):
        store.verify()


@pytest.mark.parametrize("cols", [(0, COLS), (512, 512)], ids=["whole rows", "a block of columns"])
def test_a_damaged_piece_that_is_read_is_named(
    saved: tuple[CheckpointStore, torch.Tensor, Path], cols: tuple[int, int]
) -> None:
    store, weights, shard = saved
    damage(shard, store, [(FIRST + 1) * COLS * 4])  # row 601: piece 2, among the rows read
    with pytest.raises(CorruptShardError, match="piece 2"):
        read_rows(store, cols=cols)
    with pytest.raises(CorruptShardError):
        store.verify()
    assert not torch.equal(read_rows(store, verify=False), weights[FIRST : FIRST + COUNT])


def test_a_small_chunk_has_small_pieces_so_a_partial_read_rounds_out_by_less(tmp_path: Path) -> None:
    """A 2 MiB chunk (a 4 MiB parameter of a W=2 save) gets 16 pieces of 128 KiB: rows needed at
    another world size are read out to 128 KiB edges, not 1 MiB ones. Damage 500 KiB after the
    rows read, in the same MiB but in another small piece, does not fail that read."""
    weights = torch.randn(512, 1024, generator=torch.Generator().manual_seed(4))  # 2 MiB
    store = CheckpointStore(tmp_path / "store")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"w": weights}, storage_writer=store.dcp_writer(epoch=1), no_dist=True)
    (blob,) = store.manifest().blobs
    assert blob.piece_bytes == 128 << 10 and len(blob.pieces or []) == 16
    first = 256  # rows 256..280: bytes 1 MiB .. 1.1 MiB, inside piece 8 of 128 KiB
    shard = tmp_path / "store" / "v000001" / store.manifest().shards[blob.shard].file
    data = bytearray(shard.read_bytes())
    assert blob.offset is not None
    data[blob.offset + (1 << 20) + (600 << 10)] ^= 0xFF  # piece 12; with 1 MiB pieces, the read's own
    shard.write_bytes(bytes(data))
    target = read_rows(store, cols=(0, 1024), rows=(first, 25))
    assert torch.equal(target, weights[first : first + 25])
    with pytest.raises(CorruptShardError):
        store.verify()
