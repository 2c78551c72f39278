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

import functools
import math
import os
import tempfile
from dataclasses import dataclass

import h5py
from h5py import h5d, h5p, h5s, h5t

from ..save.planner import Blob
from .dtypes import dtype_from_name, dtype_name, storage_dtype

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


LayoutKey = tuple[tuple[str, str, tuple[int, ...]], ...]


def build_shard_image(blobs: list[Blob]) -> ShardImage:
    """Lay out a shard holding ``blobs`` (in order) and describe its bytes.

    Layouts are cached by (name, dtype, shape) of the blobs: a training run saves
    the same layout every epoch, and h5py (which runs one call at a time) is then
    needed once per run, not once per save.
    """
    key: LayoutKey = tuple((b.name, dtype_name(b.dtype), tuple(b.shape)) for b in blobs)
    size, segments, offsets = _layout(key)
    index = [b.index for b in blobs]  # cached layouts refer to blobs by position
    return ShardImage(
        size,
        [Segment(s.offset, s.length, None if s.blob is None else index[s.blob], s.data) for s in segments],
        {index[pos]: off for pos, off in enumerate(offsets)},
    )


@functools.lru_cache(maxsize=32)
def _layout(key: LayoutKey) -> tuple[int, list[Segment], list[int | None]]:
    with tempfile.TemporaryDirectory(prefix="ckptflow-layout-") as tmp:
        path = os.path.join(tmp, "skeleton.h5")
        offsets = _write_skeleton(path, key)
        size = os.path.getsize(path)
        ranges = sorted(
            (off, _nbytes(dtype, shape), pos)
            for pos, (_, dtype, shape) in enumerate(key)
            if (off := offsets[pos]) is not None and _nbytes(dtype, shape)
        )
        with open(path, "rb") as f:
            segments = _segments(f, size, ranges)
    return size, segments, offsets


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return storage_dtype(dtype_from_name(dtype)).itemsize * math.prod(shape)


def _write_skeleton(path: str, key: LayoutKey) -> list[int | None]:
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_layout(h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)  # no timestamps: the same state gives the same bytes
    offsets: list[int | None] = []
    with h5py.File(path, "w", track_order=False) as f:
        f.attrs["format"] = SHARD_FORMAT
        f.attrs["format_version"] = 1
        for name, dtype, shape in key:
            space = h5s.create_simple(shape) if shape else h5s.create(h5s.SCALAR)
            tid = h5t.py_create(storage_dtype(dtype_from_name(dtype)))
            dsid = h5d.create(f.id, name.encode(), tid, space, dcpl=dcpl)
            h5py.Dataset(dsid).attrs["torch_dtype"] = dtype
            offsets.append(dsid.get_offset())
            size, expected = dsid.get_storage_size(), _nbytes(dtype, shape)
            if size != expected:
                raise AssertionError(f"HDF5 allocated {size} bytes for {name}, expected {expected}")
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
