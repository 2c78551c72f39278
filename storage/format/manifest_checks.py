"""Everything a manifest says is checked before anything acts on it.

A manifest is untrusted input: stores are shared, copied and downloaded, and a
crafted or damaged manifest must never make a reader touch a file outside its
version, allocate what the shard cannot hold, or crash with a raw exception.
The schema (types, ranges) is pydantic's job in :mod:`.manifest`; this module
checks what ties the fields together, without recursion and before any I/O:

- every shard name is one plain path component (:mod:`.names`): a shard is a
  file *inside* its version, or inside another version of the same store that
  it names by number (format 8), never its own number; no file is listed twice;
- every blob names a listed shard, a known dtype, a shape whose size times the
  dtype's width is its byte count, and a byte range inside its shard; piece
  checksums (format 5), if any, one per piece of its size;
- every tensor names a listed blob, a known dtype, and a view (shape, stride,
  offset) that stays inside that blob;
- every chunked tensor (format 4) has a known dtype and a global shape, and
  chunks that lie inside it, do not overlap, cover it exactly, and each name a
  listed blob of the chunk's dtype and size;
- the structure is at most :data:`MAX_DEPTH` deep, uses only known ``$`` tags
  with payloads of the right kind, and refers only to listed tensors;
- checksums are 16 hex digits (xxh3-64); a blob's may be 32 (xxh3-128, its
  content key, format 8).

Every violation raises :class:`ManifestError` naming the manifest and the field.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Iterator
from typing import Any, Protocol

from ..errors import ManifestError
from .dtypenames import NATIVE, itemsize
from .entries import BlobEntry, ChunkedEntry, RankPart, ShardEntry, TensorEntry
from .names import is_plain_name

MAX_DEPTH = 64  # nesting of the structure; real training states are a few levels deep
MAX_DOCUMENT_DEPTH = MAX_DEPTH + 16  # nesting of a whole manifest or index (a structure inside)
MAX_BYTES = 256 << 20  # a manifest (or an index) larger than this is refused before parsing
MAX_COUNT = 1 << 48  # a size, stride or offset in elements (or bytes) above this is not a real one
_CHECKSUM = re.compile(r"[0-9a-f]{16}")
_KEY = re.compile(r"[0-9a-f]{32}")
_HEX = re.compile(r"[0-9a-f]*")
_TAGS = {"$tensor", "$ndarray", "$chunked", "$tuple", "$float", "$bytes", "$dtype", "$dict"}
MAX_CHUNKS = 1 << 16  # chunks of one tensor: a mesh of this many ranks is far beyond any job's
_FLOATS = {"nan", "inf", "-inf"}


class Checked(Protocol):
    """What :func:`check_manifest` reads of a manifest (:class:`.manifest.Manifest`)."""

    @property
    def version(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def metrics(self) -> dict[str, float]: ...

    @property
    def shards(self) -> list[ShardEntry]: ...

    @property
    def blobs(self) -> list[BlobEntry]: ...

    @property
    def tensors(self) -> list[TensorEntry]: ...

    @property
    def chunked(self) -> list[ChunkedEntry]: ...

    @property
    def ranks(self) -> list[RankPart]: ...

    @property
    def structure(self) -> Any: ...


def check_manifest(m: Checked, where: str) -> None:
    """Raise :class:`ManifestError` for the first thing in ``m`` that cannot be trusted."""
    for name, value in m.metrics.items():
        if not math.isfinite(value):  # saving refuses them too; JSON output has no NaN
            raise _fail(where, f"metrics.{name}", f"{value} is not a finite number")
    seen: set[tuple[int | None, str]] = set()
    for i, shard in enumerate(m.shards):
        _check_shard(shard, f"shards[{i}]", where)
        if shard.version == m.version:
            raise _fail(where, f"shards[{i}].version", "names the manifest's own version (leave it out)")
        if (shard.version, shard.file) in seen:
            raise _fail(where, f"shards[{i}]", f"{shard.file!r} of that version is listed twice")
        seen.add((shard.version, shard.file))
    if m.ranks and len(m.ranks) != m.world_size:
        raise ManifestError(f"manifest {where}: {len(m.ranks)} rank parts for a world size of {m.world_size}")
    parts = [("", m.blobs, m.tensors, m.structure)]
    parts += [(f"ranks[{r}].", p.blobs, p.tensors, p.structure) for r, p in enumerate(m.ranks)]
    for prefix, blobs, tensors, structure in parts:
        # Every checksum in one match (a state may have 100,000 blobs); the slow way names a bad one.
        checksums = "".join(b.checksum for b in blobs)
        sound = all(len(b.checksum) in (16, 32) for b in blobs) and _HEX.fullmatch(checksums) is not None
        for i, blob in enumerate(blobs):
            _check_blob(blob, m.shards, f"{prefix}blobs[{i}]", where, checksum_ok=sound)
        for i, tensor in enumerate(tensors):
            if not _whole_blob(tensor, blobs):
                _check_tensor(tensor, blobs, f"{prefix}tensors[{i}]", where)
        chunked = len(m.chunked) if not prefix else 0
        _check_structure(structure, [t.dtype for t in tensors], chunked, f"{prefix}structure", where)
    for i, entry in enumerate(m.chunked):
        _check_chunked(entry, m.blobs, f"chunked[{i}]", where)


def _fail(where: str, field: str, problem: str) -> ManifestError:
    return ManifestError(f"manifest {where} is invalid: {field}: {problem}")


def _check_shard(shard: ShardEntry, field: str, where: str) -> None:
    if not is_plain_name(shard.file):
        raise _fail(where, f"{field}.file", f"{shard.file!r} is not a plain file name inside the version")
    if not _CHECKSUM.fullmatch(shard.checksum):
        raise _fail(where, f"{field}.checksum", f"{shard.checksum!r} is not an xxh3-64 checksum")


def _check_blob(
    blob: BlobEntry, shards: list[ShardEntry], field: str, where: str, *, checksum_ok: bool = False
) -> None:
    if blob.shard >= len(shards):
        raise _fail(where, f"{field}.shard", f"shard {blob.shard} is not listed ({len(shards)} shards)")
    width = _width_of(blob.dtype, blob.shape, field, where)
    if math.prod(blob.shape) * width != blob.nbytes:
        raise _fail(
            where,
            f"{field}.nbytes",
            f"{blob.nbytes} bytes for shape {blob.shape} of {blob.dtype} ({width} B each)",
        )
    if not checksum_ok and not (_CHECKSUM.fullmatch(blob.checksum) or _KEY.fullmatch(blob.checksum)):
        raise _fail(where, f"{field}.checksum", f"{blob.checksum!r} is not an xxh3-64 or xxh3-128 checksum")
    _check_pieces(blob, field, where)
    if blob.offset is None:
        if blob.nbytes:
            raise _fail(where, f"{field}.offset", "missing for a blob of non-zero size")
        return
    size = shards[blob.shard].size
    if blob.offset < 0 or blob.offset + blob.nbytes > size:
        raise _fail(
            where,
            f"{field}.offset",
            f"bytes {blob.offset}..{blob.offset + blob.nbytes} lie outside shard {blob.shard} ({size} bytes)",
        )


def _check_pieces(blob: BlobEntry, field: str, where: str) -> None:
    """Piece checksums come with their size, one per piece of the blob."""
    if (blob.piece_bytes is None) != (blob.pieces is None):
        raise _fail(where, f"{field}.pieces", "piece_bytes and pieces come together")
    if blob.piece_bytes is None or blob.pieces is None:
        return
    count = -(-blob.nbytes // blob.piece_bytes)
    if len(blob.pieces) != count:
        raise _fail(
            where,
            f"{field}.pieces",
            f"{len(blob.pieces)} checksums for {count} pieces of {blob.piece_bytes} bytes",
        )
    if all(len(c) == 16 for c in blob.pieces) and _HEX.fullmatch("".join(blob.pieces)):
        return  # one match over them all: a big chunk has one checksum per MiB
    for k, checksum in enumerate(blob.pieces):
        if not _CHECKSUM.fullmatch(checksum):
            raise _fail(where, f"{field}.pieces[{k}]", f"{checksum!r} is not an xxh3-64 checksum")


def _whole_blob(tensor: TensorEntry, blobs: list[BlobEntry]) -> bool:
    """Whether a tensor is its blob itself (most are): same dtype and shape, no view, and the
    blob's own checks (a shape of counts that are real, its size) then hold for it too."""
    blob = blobs[tensor.blob] if tensor.blob < len(blobs) else None
    return (
        blob is not None
        and tensor.stride is None
        and tensor.offset == 0
        and tensor.dtype == blob.dtype
        and tensor.shape == blob.shape
    )


def _check_tensor(tensor: TensorEntry, blobs: list[BlobEntry], field: str, where: str) -> None:
    if tensor.blob >= len(blobs):
        raise _fail(where, f"{field}.blob", f"blob {tensor.blob} is not listed ({len(blobs)} blobs)")
    blob = blobs[tensor.blob]
    width = itemsize(tensor.dtype)
    if width is None:
        raise _fail(where, f"{field}.dtype", f"unknown dtype {tensor.dtype!r}")
    if width != itemsize(blob.dtype):
        raise _fail(where, f"{field}.dtype", f"{tensor.dtype} does not match its blob's {blob.dtype}")
    problem = _counts_problem(tensor.shape)
    if problem:
        raise _fail(where, f"{field}.shape", f"{problem} in {tensor.shape}")
    elements = blob.nbytes // width
    stride = tensor.stride if tensor.stride is not None else _contiguous(tensor.shape)
    if len(stride) != len(tensor.shape) or _counts_problem(stride):
        raise _fail(where, f"{field}.stride", f"{stride} does not fit shape {tensor.shape}")
    if tensor.offset < 0 or tensor.offset > elements:
        raise _fail(where, f"{field}.offset", f"offset {tensor.offset} is outside a blob of {elements}")
    if math.prod(tensor.shape) > MAX_COUNT:
        raise _fail(where, f"{field}.shape", f"{tensor.shape} holds more than {MAX_COUNT} elements")
    if math.prod(tensor.shape) == 0:
        return
    last = tensor.offset + sum((n - 1) * s for n, s in zip(tensor.shape, stride, strict=True))
    if last >= elements:
        raise _fail(
            where,
            f"{field}",
            f"shape {tensor.shape}, stride {stride} and offset {tensor.offset} reach element {last} "
            f"of a blob of {elements}",
        )


def _check_chunked(entry: ChunkedEntry, blobs: list[BlobEntry], field: str, where: str) -> None:
    width = _width_of(entry.dtype, entry.shape, field, where)
    if len(entry.chunks) > MAX_CHUNKS:
        raise _fail(where, f"{field}.chunks", f"{len(entry.chunks)} chunks, more than {MAX_CHUNKS}")
    boxes: list[tuple[list[int], list[int]]] = []
    for j, chunk in enumerate(entry.chunks):
        name = f"{field}.chunks[{j}]"
        dims = len(entry.shape)
        if len(chunk.offsets) != dims or len(chunk.sizes) != dims:
            raise _fail(
                where, name, f"a box of {len(chunk.offsets)}/{len(chunk.sizes)} dims in a {dims}-d tensor"
            )
        if any(
            o < 0 or n < 0 or o + n > d
            for o, n, d in zip(chunk.offsets, chunk.sizes, entry.shape, strict=True)
        ):
            raise _fail(
                where, name, f"offsets {chunk.offsets} + sizes {chunk.sizes} leave shape {entry.shape}"
            )
        if chunk.blob >= len(blobs):
            raise _fail(where, f"{name}.blob", f"blob {chunk.blob} is not listed ({len(blobs)} blobs)")
        blob = blobs[chunk.blob]
        if itemsize(blob.dtype) != width or blob.nbytes != math.prod(chunk.sizes) * width:
            raise _fail(
                where,
                f"{name}.blob",
                f"blob {chunk.blob} holds {blob.nbytes} bytes of {blob.dtype}, "
                f"not {chunk.sizes} of {entry.dtype}",
            )
        boxes.append((chunk.offsets, chunk.sizes))
    covered = sum(math.prod(sizes) for _, sizes in boxes)
    if covered != math.prod(entry.shape) or _overlap(boxes):
        raise _fail(where, f"{field}.chunks", f"the chunks do not cover shape {entry.shape} once exactly")


def _width_of(dtype: str, shape: list[int], field: str, where: str) -> int:
    """The byte width of a known ``dtype``, once ``shape`` is checked to be a real one."""
    width = itemsize(dtype)
    if width is None:
        raise _fail(where, f"{field}.dtype", f"unknown dtype {dtype!r}")
    problem = _counts_problem(shape)
    if problem:
        raise _fail(where, f"{field}.shape", f"{problem} in {shape}")
    return width


def _overlap(boxes: list[tuple[list[int], list[int]]]) -> bool:
    """Whether two non-empty boxes share an element (sorted by their first offset, so mostly linear)."""
    live = sorted((b for b in boxes if math.prod(b[1])), key=lambda b: b[0])
    for i, (start, size) in enumerate(live):
        for other, other_size in live[i + 1 :]:
            if start and other[0] >= start[0] + size[0]:
                break
            if all(
                a < c + m and c < a + n for a, n, c, m in zip(start, size, other, other_size, strict=True)
            ):
                return True
    return False


def _counts_problem(counts: list[int]) -> str | None:
    """Why a shape or stride cannot be a real one (None: it can)."""
    if any(n < 0 for n in counts):
        return "a negative number"
    if any(n > MAX_COUNT for n in counts) or math.prod(counts) > MAX_COUNT:
        return f"a number above {MAX_COUNT}"
    return None


def _contiguous(shape: list[int]) -> list[int]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return stride[::-1]


def _check_structure(structure: Any, dtypes: list[str], chunked: int, field: str, where: str) -> None:
    for node, depth in _containers(structure):
        if depth + bool(node) > MAX_DEPTH:  # its values lie one level below it
            raise _fail(where, field, f"nested deeper than {MAX_DEPTH} levels")
        if not isinstance(node, dict) or len(node) != 1:
            continue
        ((tag, payload),) = node.items()
        if not tag.startswith("$"):
            continue
        problem = _tag_problem(tag, payload, dtypes, chunked)
        if problem:
            raise _fail(where, field, problem)


def _tag_problem(tag: str, payload: Any, dtypes: list[str], chunked: int) -> str | None:
    if tag not in _TAGS:
        return f"unknown tag {tag!r}"
    if tag == "$chunked":
        ok = isinstance(payload, int) and not isinstance(payload, bool) and 0 <= payload < chunked
        return None if ok else f"$chunked {payload!r} is not one of the {chunked} chunked tensors"
    if tag in ("$tensor", "$ndarray"):
        ok = isinstance(payload, int) and not isinstance(payload, bool) and 0 <= payload < len(dtypes)
        if not ok:
            return f"{tag} {payload!r} is not one of the {len(dtypes)} tensors"
        if tag == "$ndarray" and dtypes[payload] not in NATIVE:
            return f"$ndarray {payload} is a {dtypes[payload]} tensor, which numpy cannot hold"
        return None
    if tag == "$float":
        return None if payload in _FLOATS else f"$float {payload!r} is not nan, inf or -inf"
    if tag == "$dtype":
        return None if isinstance(payload, str) and itemsize(payload) else f"unknown $dtype {payload!r}"
    if tag == "$bytes":
        try:
            base64.b64decode(payload, validate=True)
        except (binascii.Error, TypeError, ValueError):
            return "$bytes is not base64"
        return None
    if tag == "$tuple":
        return None if isinstance(payload, list) else "$tuple is not a list"
    pairs = isinstance(payload, list) and all(isinstance(p, list) and len(p) == 2 for p in payload)
    if not pairs:
        return "$dict is not a list of [key, value] pairs"
    bad = next((k for k, _ in payload if not _is_key(k)), None)
    return None if bad is None else f"$dict key {bad!r} is not a number, string, None or tuple of them"


def _is_key(key: Any) -> bool:
    """Whether ``key`` decodes to a hashable dict key: a scalar, or a tagged float, dtype, bytes,
    or a tuple of keys."""
    stack = [key]
    while stack:
        node = stack.pop()
        if node is None or isinstance(node, (str, int, float)):
            continue
        if not isinstance(node, dict) or len(node) != 1:
            return False
        ((tag, payload),) = node.items()
        if tag == "$tuple" and isinstance(payload, list):
            stack.extend(payload)
        elif tag not in ("$float", "$dtype", "$bytes"):
            return False
    return True


def json_depth(value: Any) -> int:
    """How deeply a JSON value nests (a scalar or an empty container: 0), without recursion."""
    return max((depth + 1 for node, depth in _containers(value) if node), default=0)


def document_depth_problem(raw: Any) -> str | None:
    """Why a whole JSON document is nested too deeply to be read safely (None: it is not)."""
    deepest = json_depth(raw)
    if deepest > MAX_DOCUMENT_DEPTH:
        return f"nested {deepest} levels deep, more than the {MAX_DOCUMENT_DEPTH} allowed"
    return None


def _containers(root: Any) -> Iterator[tuple[dict | list, int]]:
    """Every dict and list of a JSON value with its depth, without recursion (a deep structure
    cannot crash it). Scalars are never visited: in a manifest they are most of the nodes (piece
    checksums, shapes), and a container's depth + 1 is already the depth of its values."""
    if not isinstance(root, (dict, list)):
        return
    stack: list[tuple[dict | list, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        yield node, depth
        below = depth + 1
        values = node.values() if isinstance(node, dict) else node
        stack.extend([(v, below) for v in values if isinstance(v, (dict, list))])
