"""How a load onto a GPU groups blobs into pinned blocks (storage/load/gpu.py): the plan is pure,
so it is tested here; the copies themselves run in tests/cuda."""

from __future__ import annotations

from ckptflow.storage.load import gpu

MiB = 1 << 20


def test_each_group_fits_one_block_with_its_padding():
    sizes = {i: 3 * MiB + 1 for i in range(60)}  # 64-byte padding each: 21 fit in 64 MiB, not 22
    groups = gpu.batches(sizes)
    assert [len(g) for g in groups] == [21, 21, 18]
    assert all(sum(gpu.padded(sizes[b]) for b in g) <= gpu.BATCH_BYTES for g in groups)
    assert [b for g in groups for b in g] == list(sizes)


def test_empty_blobs_and_a_blob_larger_than_a_block():
    sizes = {7: 0, 8: 0, 9: 100 * MiB, 10: 5}
    assert gpu.batches(sizes) == [[7, 8], [9], [10]]
    assert gpu.batches({}) == []


def test_padding_keeps_every_region_aligned_for_any_dtype():
    assert [gpu.padded(n) for n in (0, 1, 64, 65, 4096)] == [0, 64, 64, 128, 4096]
