"""What changed between two checkpoints: tensors added, removed, retyped, reshaped or changed in
value, and the other values of the state (step counters, learning rates) that changed.

A side is a committed version of a store, or a ``torch.save`` / safetensors file. Tensors are
matched by key path (``model/fc.weight``; a safetensors file's names are such paths, as
``ckptflow restore --format safetensors`` writes them). Between store versions, a tensor's stored
checksum tells whether its bytes changed, so nothing is read unless values are asked for; a file's
tensors are hashed the same way. Where the checksums cannot tell (a tensor stored as a view of a
larger blob, or chunked differently by sharded saves of other world sizes), both tensors are read
and compared. With ``values=True``, the tensors that changed are read, and the bytes that differ,
the largest absolute difference and the relative norm of the difference are reported.

Memory stays bounded whatever the tensors' sizes: small tensors are read a batch of about
``READ_BATCH`` bytes per side at a time; a tensor of ``WINDOW`` bytes or more is compared a window
at a time (a stored chunk, or a range of its blob, verified as it streams), its figures summed over
the windows, so two versions of a 512 MiB tensor never hold more than a few windows in memory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError
from .format.names import version_dir

if TYPE_CHECKING:
    import torch

    from .format.manifest import Manifest
    from .load.store_reader import StoreReader

READ_BATCH = 64 << 20  # small tensors read together, per side, when values are compared
WINDOW = 8 << 20  # a tensor this large is compared this many bytes at a time, per side
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


@dataclass(frozen=True)
class TensorFacts:
    dtype: str
    shape: list[int]
    nbytes: int


@dataclass(frozen=True)
class TensorChange:
    """One tensor that differs: ``kind`` is ``added``, ``removed``, ``dtype``, ``shape`` or ``values``.

    ``nbytes``: the bytes of the tensor as it is now (as it was, for a removed one). With values
    compared: ``differing_bytes`` of its bytes differ, ``max_abs`` is the largest absolute
    difference of an element and ``rel_norm`` the norm of the difference over the norm of the
    older tensor (None where it has none: bool tensors, a zero older tensor)."""

    path: str
    kind: str
    before: TensorFacts | None
    after: TensorFacts | None
    nbytes: int
    differing_bytes: int | None = None
    max_abs: float | None = None
    rel_norm: float | None = None


@dataclass(frozen=True)
class ValueChange:
    """A value of the state that is not a tensor: ``kind`` is ``added``, ``removed`` or ``changed``
    (``before`` / ``after`` are None on the side it is absent from)."""

    path: str
    kind: str
    before: Any
    after: Any


@dataclass(frozen=True)
class StateDiff:
    before: str
    after: str
    changes: list[TensorChange]
    unchanged: int  # tensors whose bytes are the same
    unchanged_bytes: int
    values: list[ValueChange] = field(default_factory=list)
    compared_values: bool = False

    @property
    def changed_bytes(self) -> int:
        """The bytes of the tensors that are new or changed (what an incremental save writes)."""
        return sum(c.nbytes for c in self.changes if c.kind != "removed")

    def count(self, kind: str) -> int:
        return sum(1 for c in self.changes if c.kind == kind)

    def is_empty(self) -> bool:
        return not self.changes and not self.values

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["changed_bytes"] = self.changed_bytes
        return document


# -- the two sides ---------------------------------------------------------------------------


class _Side:
    """What a diff needs of a checkpoint: its tensors' facts and fingerprints, its other values, and
    a way to read tensors by key path."""

    label: str
    facts: dict[str, TensorFacts]
    # Equal fingerprints: equal bytes. ("bytes <algorithm>", checksum) compares across kinds of
    # side, ("chunks <algorithm>", boxes) only where the boxes agree; None: unknown unless read.
    prints: dict[str, tuple | None]
    values: dict[str, Any]

    def read(self, paths: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def windows(self, path: str) -> Iterator[torch.Tensor]:
        """The tensor at ``path`` as consecutive flat pieces of at most about WINDOW bytes."""
        yield from _flat_windows(self.read([path])[path])


def _flat_windows(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = tensor.detach().reshape(-1)
    step = max(1, WINDOW // max(1, flat.element_size()))
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step]


class _VersionSide(_Side):
    def __init__(self, reads: StoreReader, version: int | None) -> None:
        manifest = reads.manifest(version)
        self.reads, self.version = reads, manifest.version
        self.label = reads.loc.display(version_dir(manifest.version))
        self.facts, self.prints = _manifest_tensors(manifest)
        self.values = dict(_leaf_values(manifest.structure))

    def read(self, paths: list[str]) -> dict[str, torch.Tensor]:
        from .format.structure import encode

        state = self.reads.load(self.version, keys=paths)
        _, leaves = encode(state)
        return {leaf.path: leaf.tensor for leaf in leaves}

    def windows(self, path: str) -> Iterator[torch.Tensor]:
        """Chunk by chunk for a chunked tensor of whole rows (each chunk read and verified on its
        own); a range of its blob at a time for a tensor that is one whole blob (verified as it
        streams: the blob's checksum over the ranges, checked after the last); else whole."""
        from .format.dtypes import dtype_from_name
        from .load.reader import Span, read_blobs, read_spans

        located = self.reads.locate(self.version)
        manifest, loc = located.manifest, self.reads.loc
        sources = located.sources(loc)
        threads = self.reads.options.threads
        chunked = next((c for c in manifest.chunked if c.path == path), None)
        tensor = next((t for t in manifest.tensors if t.path == path), None)
        if chunked is not None and all(k.sizes[1:] == chunked.shape[1:] for k in chunked.chunks):
            dtype = dtype_from_name(chunked.dtype)
            for k in sorted(chunked.chunks, key=lambda k: k.offsets):
                data = read_blobs(loc, sources, manifest, [k.blob], verify=True, threads=threads)[k.blob]
                yield from _flat_windows(data.view(dtype))
            return
        blob = manifest.blobs[tensor.blob] if tensor is not None else None
        whole = (
            tensor is not None
            and blob is not None
            and blob.offset is not None
            and tensor.stride is None
            and tensor.offset == 0
            and blob.dtype == tensor.dtype
            and blob.nbytes == tensor.nbytes
        )
        if not whole or tensor is None or blob is None:
            yield from super().windows(path)
            return
        from .errors import CorruptShardError
        from .format.checksum import blob_hasher

        dtype = dtype_from_name(tensor.dtype)
        item = dtype.itemsize if hasattr(dtype, "itemsize") else 1
        step = max(item, WINDOW // item * item)
        hasher = blob_hasher(blob.checksum)
        for start in range(0, blob.nbytes, step):
            span = Span(tensor.blob, start, min(blob.nbytes, start + step))
            [data] = read_spans(loc, sources, manifest, [span], verify=False, threads=threads)
            hasher.update(data.numpy().data)
            yield data.view(dtype)
        if hasher.hexdigest() != blob.checksum:
            raise CorruptShardError(
                f"{sources[blob.shard].name} (dataset {blob.dataset})",
                expected=blob.checksum,
                actual=hasher.hexdigest(),
            )


class _FileSide(_Side):
    def __init__(self, path: Path) -> None:
        from .files.byteio import tensor_bytes
        from .format.checksum import KEY_ALGORITHM, content_key
        from .format.dtypes import dtype_name
        from .format.structure import encode
        from .load.foreign import read_safetensors, read_torch_file

        self.label = str(path)
        # as import reads them: the two accept and refuse the same files
        state: Any = read_safetensors(path) if path.suffix == ".safetensors" else read_torch_file(path)
        try:
            structure, leaves = encode(state)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        self.tensors = {leaf.path: leaf.tensor for leaf in leaves}
        self.facts = {
            p: TensorFacts(dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size())
            for p, t in self.tensors.items()
        }
        kind = f"bytes {KEY_ALGORITHM}"  # as a content-addressed save's blob checksums
        self.prints = {p: (kind, content_key(tensor_bytes(t))) for p, t in self.tensors.items()}
        self.values = dict(_leaf_values(structure))

    def read(self, paths: list[str]) -> dict[str, torch.Tensor]:
        return {p: self.tensors[p] for p in paths}


def _manifest_tensors(manifest: Manifest) -> tuple[dict[str, TensorFacts], dict[str, tuple | None]]:
    from .format.checksum import KEY_ALGORITHM, KEY_DIGITS

    facts: dict[str, TensorFacts] = {}
    prints: dict[str, tuple | None] = {}

    def algorithm(checksum: str) -> str:  # a blob's: xxh3-128 (a content key, format 8) or the manifest's
        return KEY_ALGORITHM if len(checksum) == KEY_DIGITS else manifest.checksum_algorithm

    for t in manifest.tensors:
        blob = manifest.blobs[t.blob]
        nbytes = t.nbytes or 0
        facts[t.path] = TensorFacts(t.dtype, list(t.shape), nbytes)
        whole = t.stride is None and t.offset == 0 and blob.dtype == t.dtype and blob.nbytes == nbytes
        prints[t.path] = (f"bytes {algorithm(blob.checksum)}", blob.checksum) if whole else None
    for c in manifest.chunked:
        facts[c.path] = TensorFacts(c.dtype, list(c.shape), c.nbytes)
        first = manifest.blobs[c.chunks[0].blob].checksum if c.chunks else ""
        if len(c.chunks) == 1 and c.chunks[0].sizes == c.shape:  # one chunk: the whole tensor's bytes
            prints[c.path] = (f"bytes {algorithm(first)}", first)
        else:  # the same boxes with the same checksums: the same bytes
            boxes = tuple(
                (tuple(k.offsets), tuple(k.sizes), manifest.blobs[k.blob].checksum)
                for k in sorted(c.chunks, key=lambda k: k.offsets)
            )
            prints[c.path] = (f"chunks {algorithm(first)}", boxes)
    return facts, prints


def _leaf_values(structure: Any) -> Iterator[tuple[str, Any]]:
    """The non-tensor leaves of an encoded structure, by key path."""
    from .format.structure import decode

    tensor = object()
    state = decode(structure, lambda index, is_numpy: tensor, lambda index: tensor)
    for path, value in _leaf_values_of(state, ""):
        if value is not tensor:
            yield path, _plain(value)


def _leaf_values_of(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Key paths as :func:`.structure.encode` makes them; a leaf's JSON-ready value."""
    from .format.structure import join_path

    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, join_path(where, k)) for k, v in reversed(list(item.items())))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, join_path(where, i)) for i, v in reversed(list(enumerate(item))))
        else:
            yield where, item


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN or Infinity
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def file_side(spec: str | os.PathLike[str]) -> _Side | None:
    """The torch or safetensors file ``spec`` names, or None when it names none."""
    path = Path(spec)
    return _FileSide(path) if path.suffix in FILE_SUFFIXES and path.is_file() else None


def version_side(reads: StoreReader, version: int | None) -> _Side:
    """A committed version of the store ``reads`` reads (None: the newest)."""
    return _VersionSide(reads, version)


def split_version(spec: str) -> tuple[str, int | None]:
    """``URL@N`` as (URL, N); a spec without a version number after its last ``@``: (spec, None)."""
    url, _, number = spec.rpartition("@")
    return (url, int(number)) if url and number.isdigit() else (spec, None)


def no_side(spec: str) -> CheckpointError:
    return CheckpointError(
        f"{spec!r} is no version number, no torch or safetensors file ({', '.join(FILE_SUFFIXES)}) and "
        "no store: give a version of the store, a file, or another store's URL (URL@N for its version N)"
    )


# -- the comparison --------------------------------------------------------------------------


def compare(before: _Side, after: _Side, *, values: bool = False) -> StateDiff:
    """What changed from ``before`` to ``after``."""
    changes: dict[str, TensorChange] = {}
    unknown: list[str] = []  # same dtype and shape, fingerprints that cannot tell: read both
    unchanged: list[str] = []
    for path, old in before.facts.items():
        new = after.facts.get(path)
        if new is None:
            changes[path] = TensorChange(path, "removed", old, None, old.nbytes)
        elif old.dtype != new.dtype:
            changes[path] = TensorChange(path, "dtype", old, new, new.nbytes)
        elif old.shape != new.shape:
            changes[path] = TensorChange(path, "shape", old, new, new.nbytes)
        else:
            a, b = before.prints.get(path), after.prints.get(path)
            if a is not None and b is not None and a[0] == b[0] and _same_boxes(a, b):
                if a == b:
                    unchanged.append(path)
                else:
                    changes[path] = TensorChange(path, "values", old, new, new.nbytes)
            else:
                unknown.append(path)
    for path, new in after.facts.items():
        if path not in before.facts:
            changes[path] = TensorChange(path, "added", None, new, new.nbytes)
    to_read = unknown + ([p for p, c in changes.items() if c.kind == "values"] if values else [])
    large = [p for p in to_read if before.facts[p].nbytes >= WINDOW]
    small = [p for p in to_read if before.facts[p].nbytes < WINDOW]
    measures = (
        *((p, _measure_windows(before.windows(p), after.windows(p), values)) for p in large),
        *((p, _measure(a, b, values)) for p, (a, b) in _read_pairs(before, after, small)),
    )
    for path, measured in measures:
        if measured is None:
            unchanged.append(path)
        else:
            old, new = before.facts[path], after.facts[path]
            changes[path] = TensorChange(path, "values", old, new, new.nbytes, *measured)
    order = {p: i for i, p in enumerate([*before.facts, *(p for p in after.facts if p not in before.facts)])}
    value_changes = [
        ValueChange(p, _value_kind(before.values, after.values, p), before.values.get(p), after.values.get(p))
        for p in [*before.values, *(p for p in after.values if p not in before.values)]
        if before.values.get(p, _ABSENT) != after.values.get(p, _ABSENT)
    ]
    return StateDiff(
        before.label,
        after.label,
        sorted(changes.values(), key=lambda c: order[c.path]),
        len(unchanged),
        sum(after.facts[p].nbytes for p in unchanged),
        value_changes,
        values,
    )


_ABSENT = object()


def _value_kind(before: dict[str, Any], after: dict[str, Any], path: str) -> str:
    return "added" if path not in before else "removed" if path not in after else "changed"


def _same_boxes(a: tuple, b: tuple) -> bool:
    """Two fingerprints of one kind that can be compared: whole tensors, or chunks in the same boxes."""
    if not a[0].startswith("chunks"):
        return True
    return [box[:2] for box in a[1]] == [box[:2] for box in b[1]]


def _read_pairs(
    before: _Side, after: _Side, paths: list[str]
) -> Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Both sides' tensors at ``paths``, read a batch of about READ_BATCH bytes at a time."""
    batch: list[str] = []
    size = 0
    for path in [*paths, None]:
        if path is not None:
            batch.append(path)
            size += before.facts[path].nbytes
            if size < READ_BATCH:
                continue
        if batch:
            olds, news = before.read(batch), after.read(batch)
            for p in batch:
                yield p, (olds[p], news[p])
        batch, size = [], 0


def _measure_windows(
    olds: Iterator[torch.Tensor], news: Iterator[torch.Tensor], values: bool
) -> tuple[int, float | None, float | None] | None:
    """:func:`_measure` of two tensors given as flat windows (of any lengths), summed window by
    window: the bytes that differ, the largest absolute difference, the relative norm."""

    differing, max_abs, delta_sq, old_sq, numbers = 0, None, 0.0, 0.0, True
    for old, new in _aligned(olds, news):
        part = _window_figures(old, new, values)
        differing += part[0]
        numbers = numbers and part[1] is not None
        if part[1] is not None:
            found = part[1][0]
            max_abs = found if max_abs is None or (found is not None and found > max_abs) else max_abs
            delta_sq += part[1][1]
            old_sq += part[1][2]
    if differing == 0:
        return None
    if not values or not numbers:
        return differing, None, None
    return differing, max_abs, (math.sqrt(delta_sq) / math.sqrt(old_sq) if old_sq else None)


def _aligned(
    olds: Iterator[torch.Tensor], news: Iterator[torch.Tensor]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of equal-length pieces of two flat tensors given as windows of different lengths."""
    old_rest = new_rest = None
    while True:
        if old_rest is None or old_rest.numel() == 0:
            old_rest = next(olds, None)
        if new_rest is None or new_rest.numel() == 0:
            new_rest = next(news, None)
        if old_rest is None or new_rest is None:
            return
        n = min(old_rest.numel(), new_rest.numel())
        yield old_rest[:n], new_rest[:n]
        old_rest, new_rest = old_rest[n:], new_rest[n:]


def _window_figures(
    a: torch.Tensor, b: torch.Tensor, values: bool
) -> tuple[int, tuple[float | None, float, float] | None]:
    """One window's bytes that differ, and (for numbers, with ``values``) its largest finite
    absolute difference and the sums of squares of the finite differences and old values. Its
    temporaries are a few times the window's bytes (in place where it can)."""
    import torch

    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    differing = int(torch.ne(a.view(torch.uint8), b.view(torch.uint8)).sum()) if a.numel() else 0
    if not values or a.dtype == torch.bool or a.is_complex():
        return differing, None
    old = a.double()
    old_sq = float(torch.where(torch.isfinite(old), old, 0.0).square_().sum())
    if differing == 0:
        return 0, (None, 0.0, old_sq)
    delta = b.double().sub_(old).abs_()
    del old
    finite = torch.isfinite(delta)
    max_abs = float(delta[finite].max()) if bool(finite.any()) else None
    delta = torch.where(finite, delta, 0.0)
    return differing, (max_abs, float(delta.square_().sum()), old_sq)


def _measure(a: torch.Tensor, b: torch.Tensor, values: bool) -> tuple[int, float | None, float | None] | None:
    """None when the two tensors hold the same bytes; else the bytes that differ and, for numbers,
    the largest absolute difference and the relative norm of the difference."""
    import torch

    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    raw_a, raw_b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    differing = int((raw_a != raw_b).sum()) if a.numel() else 0
    if differing == 0:
        return None
    if not values or a.dtype == torch.bool or a.is_complex():
        return differing, None, None
    old, new = a.double(), b.double()
    delta = (new - old).abs()
    finite = torch.isfinite(delta)
    max_abs = float(delta[finite].max()) if bool(finite.any()) else None
    norm = float(torch.linalg.vector_norm(old[torch.isfinite(old)]))
    rel = float(torch.linalg.vector_norm(delta[finite])) / norm if norm else None
    return differing, max_abs, rel


__all__ = ["StateDiff", "TensorChange", "TensorFacts", "ValueChange", "compare", "file_side", "version_side"]
