"""Write a planned state as HDF5 shards, in parallel, one thread per shard.

Each shard is laid out by :mod:`.h5layout` and then streamed front to back:
metadata bytes from the layout, tensor bytes straight from memory. While the
bytes go out, they are hashed into the shard's checksum (the whole file) and,
unless a content-addressed save computed each blob's key before (:mod:`.dedup`),
into the blob's own checksum. A shard is complete only when its
sink commits (fsync on local disks, the final part on object stores); the
manifest that references it is written afterwards by :mod:`.commit`.

Every file is written under a name no other save uses: the planned name with the token of this
call (:func:`..format.names.identified_name`), its identity. A later save references the file, a
mirror skips it and a removal keeps it only under that name (:mod:`.dedup`, :mod:`..remote.mirror`).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..files.byteio import open_sink, write_hashed
from ..files.location import Location
from ..format.blob import Blob, BlobBytes
from ..format.checksum import content_key, digest, key_hasher, new_hasher, piece_size
from ..format.dtypes import dtype_name
from ..format.h5layout import build_shard_image
from ..format.manifest import ShardEntry, blob_doc
from ..format.names import identified_name, new_file_token
from .planner import SavePlan, ShardPlan

log = logging.getLogger(__name__)

SMALL = 64 << 10  # segments up to this size are gathered ...
BATCH = 4 << 20  # ... into writes of about this size


def write_shards(
    loc: Location,
    version_dir: str,
    plan: SavePlan,
    blob_bytes: BlobBytes,
    *,
    threads: int,
    rank: int = 0,
    piece_bytes: int | None = None,
    keys: dict[int, str] | None = None,
) -> tuple[list[ShardEntry], dict[int, dict[str, Any]]]:
    """Write every shard of ``plan`` under ``version_dir``; return their manifest entries.

    The blob entries (JSON: :func:`.blob_doc`) are keyed by blob index: those of the blobs in
    ``plan.shards``, which in a multi-process save are this rank's share of ``plan.blobs``. With
    ``piece_bytes``, each blob also gets a checksum per piece of that size (smaller for a small
    blob: :func:`piece_size`). ``keys`` (a content-addressed save, :mod:`.dedup`): the content keys
    computed before the write, their blobs' checksums; the other blobs' checksums are their content
    keys too (xxh3-128), computed as they are written.
    """
    if loc.is_local:  # object stores need no directories, and s3fs's makedirs would create a bucket
        loc.fs.makedirs(loc.path(version_dir), exist_ok=True)
    blob_entries: dict[int, dict[str, Any]] = {}
    token = new_file_token()

    def one(shard: ShardPlan) -> ShardEntry:
        entry, blobs = _write_shard(
            loc,
            version_dir,
            shard,
            identified_name(shard.file, token),
            plan.blobs,
            blob_bytes,
            rank,
            piece_bytes,
            keys,
        )
        blob_entries.update(blobs)
        return entry

    workers = max(1, min(threads, len(plan.shards)))
    if workers == 1:
        shard_entries = [one(s) for s in plan.shards]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="ckptflow-write") as pool:
            shard_entries = list(pool.map(one, plan.shards))
    return shard_entries, blob_entries


def _write_shard(
    loc: Location,
    version_dir: str,
    shard: ShardPlan,
    name: str,
    blobs: list[Blob],
    blob_bytes: BlobBytes,
    rank: int,
    piece_bytes: int | None,
    keys: dict[int, str] | None,
) -> tuple[ShardEntry, dict[int, dict[str, Any]]]:
    members = [blobs[i] for i in shard.blobs]
    image = build_shard_image(members)
    path = loc.path(version_dir, name)
    file_hash = new_hasher()
    sums: dict[int, str] = {}
    piece_sums: dict[int, list[str]] = {}
    sink = open_sink(loc.fs, path, local=loc.is_local)
    pending: list[bytes | memoryview] = []  # small segments, written (and hashed into the file's) as one
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending_bytes
        if pending:
            write_hashed(sink, b"".join(pending), file_hash)
            pending.clear()
            pending_bytes = 0

    try:
        for seg in image.segments:
            data = seg.data if seg.blob is None else blob_bytes(blobs[seg.blob])
            if seg.blob is not None and len(data) != seg.length:
                raise AssertionError(
                    f"blob {blobs[seg.blob].name}: {len(data)} bytes, layout has {seg.length}"
                )
            if len(data) <= SMALL and (seg.blob is None or not piece_bytes):
                # Thousands of small tensors cost one write and one hash call each, not three.
                if seg.blob is not None and (keys is None or seg.blob not in keys):
                    sums[seg.blob] = digest(data) if keys is None else content_key(data)
                pending.append(data)
                pending_bytes += len(data)
                if pending_bytes >= BATCH:
                    flush()
                continue
            flush()
            keyed = keys is not None and seg.blob in keys  # hashed before: its pieces only, if any
            if seg.blob is None or (keyed and not piece_bytes):
                write_hashed(sink, data, file_hash)
                continue
            pieces = (
                (piece_size(len(data), piece_bytes), piece_sums.setdefault(seg.blob, []))
                if piece_bytes
                else None
            )
            if keyed:
                write_hashed(sink, data, file_hash, pieces=pieces)
                continue
            blob_hash = new_hasher() if keys is None else key_hasher()
            write_hashed(sink, data, file_hash, blob_hash, pieces=pieces)
            sums[seg.blob] = blob_hash.hexdigest()
        flush()
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    empty = new_hasher().hexdigest() if keys is None else content_key(b"")
    names = {dtype: dtype_name(dtype) for dtype in {b.dtype for b in members}}
    entries = {}
    for b in members:
        nbytes = b.nbytes
        entries[b.index] = blob_doc(
            shard=shard.index,
            dataset=b.name,
            offset=image.offsets[b.index],
            nbytes=nbytes,
            dtype=names[b.dtype],
            shape=list(b.shape),
            checksum=keys[b.index] if keys is not None and b.index in keys else sums.get(b.index, empty),
            piece_bytes=piece_size(nbytes, piece_bytes) if piece_bytes else None,
            pieces=piece_sums.get(b.index, []) if piece_bytes else None,
        )
    log.debug("wrote %s (%d bytes, %d blobs)", path, image.size, len(members))
    return ShardEntry(file=name, size=image.size, checksum=file_hash.hexdigest(), rank=rank), entries
