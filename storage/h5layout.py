"""HDF5 shard layout: h5py writes the metadata, we move the tensor bytes.

h5py serialises every call through one global lock, so threads that write
tensors through h5py never overlap. Instead, h5py lays out the file: every
blob becomes a contiguous dataset with its space allocated at creation and no
fill values written, and HDF5 tells us the byte offset of each dataset. That
skeleton file is sparse (a few KiB of metadata around holes). We keep its
metadata bytes and describe the final shard as an ordered list of segments,
metadata or blob, covering the file. The writer then streams those segments
to any destination, copying tensor bytes straight from their memory: no
second copy of the state, no h5py lock, and a sequential write that a local
disk and an object store's multipart upload both like.

The result is an ordinary HDF5 file: h5py (or any HDF5 reader) opens it and
finds one dataset per blob, with the torch dtype in its ``torch_dtype``
attribute.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import h5py
import numpy as np
from h5py import h5d, h5p, h5s, h5t

from .dtypes import dtype_name, storage_dtype
from .planner import Blob

SHARD_FORMAT = "ckptflow-shard"


@dataclass(frozen=True)
class Segment:
    """A byte range of the shard: metadata bytes, or the bytes of one blob."""

    offset: int
    length: int
    blob: int | None = None
    data: bytes = b""


@dataclass(frozen=True)
class ShardImage:
    size: int
    segments: list[Segment]
    offsets: dict[int, int | None]  # blob index -> byte offset in the file (None: no bytes)


def build_shard_image(blobs: list[Blob]) -> ShardImage:
    """Lay out a shard holding ``blobs`` (in order) and describe its bytes."""
    with tempfile.TemporaryDirectory(prefix="ckptflow-layout-") as tmp:
        path = os.path.join(tmp, "skeleton.h5")
        offsets = _write_skeleton(path, blobs)
        size = os.path.getsize(path)
        ranges = sorted(
            (off, b.nbytes, b.index) for b in blobs if (off := offsets[b.index]) is not None and b.nbytes
        )
        with open(path, "rb") as f:
            segments = _segments(f, size, ranges)
    return ShardImage(size, segments, offsets)


def _write_skeleton(path: str, blobs: list[Blob]) -> dict[int, int | None]:
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_layout(h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
    offsets: dict[int, int | None] = {}
    with h5py.File(path, "w", track_order=False) as f:
        f.attrs["format"] = SHARD_FORMAT
        f.attrs["format_version"] = 1
        for blob in blobs:
            space = h5s.create_simple(blob.shape) if blob.shape else h5s.create(h5s.SCALAR)
            tid = h5t.py_create(storage_dtype(blob.dtype))
            dsid = h5d.create(f.id, blob.name.encode(), tid, space, dcpl=dcpl)
            h5py.Dataset(dsid).attrs["torch_dtype"] = dtype_name(blob.dtype)
            offsets[blob.index] = dsid.get_offset()
            size = dsid.get_storage_size()
            if size != blob.nbytes:
                raise AssertionError(f"HDF5 allocated {size} bytes for {blob.name}, expected {blob.nbytes}")
    return offsets


def _segments(f, size: int, ranges: list[tuple[int, int, int]]) -> list[Segment]:
    segments: list[Segment] = []
    pos = 0
    for off, length, index in [*ranges, (size, 0, -1)]:
        if off < pos:
            raise AssertionError("HDF5 laid out overlapping datasets")
        if off > pos:
            f.seek(pos)
            segments.append(Segment(pos, off - pos, None, f.read(off - pos)))
        if index >= 0:
            segments.append(Segment(off, length, index))
        pos = off + length
    return segments


def read_blob_h5(path: str, dataset: str) -> np.ndarray:
    """Read one dataset with h5py (used by tests and tools, not by the loader)."""
    with h5py.File(path, "r") as f:
        return f[dataset][()]
