"""Pure translation between torch.distributed.checkpoint's metadata and ckptflow's manifest.

DCP describes a checkpoint as a flat dict: each key (an *fqn*, the key path
joined by dots) is either a tensor of a global shape stored as chunks (boxes
of it, each written by one rank) or a non-tensor value; the planner's
``mappings`` give each fqn's path in the nested state. ckptflow's manifest
keeps the nested state as its JSON ``structure`` instead, with a
``{"$chunked": i}`` leaf for each chunked tensor and non-tensor values inline
as JSON (never as torch.save bytes), and the chunks' bytes as ordinary blobs.

The way back, for :class:`~.reader.DcpReader`: the structure is decoded with
meta tensors in place of the tensors, and DCP's own planner flattens it, so
the fqns are the ones DCP computes for the state it loads into, whichever
way the version was written (``dcp.save`` or ``CheckpointStore.save``).
Nothing here does I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedValueError
from ..format.dtypes import dtype_from_name
from ..format.entries import ChunkedEntry, ChunkEntry
from ..format.manifest import Manifest
from ..format.structure import ChunkedRef, Json, decode, encode

Path = tuple[str | int, ...]


def nest(entries: Iterable[tuple[Path, Any]]) -> dict[str, Any]:
    """A nested state from (path, value) pairs: string parts are dict keys, int parts list indices."""
    root: dict[str, Any] = {}
    for path, value in entries:
        if not path:
            raise UnsupportedValueError("", "a value with an empty key path")
        node: Any = root
        for part, following in itertools.pairwise(path):
            node = _child(node, part, [] if isinstance(following, int) else {})
        _set(node, path[-1], value)
    return root


def _child(node: Any, part: str | int, empty: Any) -> Any:
    if isinstance(node, list):
        assert isinstance(part, int)
        while len(node) <= part:
            node.append(None)
        if node[part] is None:
            node[part] = empty
        return node[part]
    return node.setdefault(part, empty)


def _set(node: Any, part: str | int, value: Any) -> None:
    if isinstance(node, list):
        assert isinstance(part, int)
        while len(node) <= part:
            node.append(None)
    node[part] = value


def path_text(path: Path) -> str:
    """A key path as ckptflow writes it in messages and manifests: ``model/blocks.0.weight``."""
    return "/".join(str(p) for p in path)


def sharded_structure(
    values: dict[str, Any], tensors: dict[str, ChunkedEntry], mappings: dict[str, Path]
) -> Json:
    """The manifest structure of a DCP save: each fqn put at its path (``mappings``; an fqn the
    planner did not map is a top-level key), tensors as ``$chunked`` leaves in ``tensors``' order."""
    order = {fqn: i for i, fqn in enumerate(tensors)}
    entries: list[tuple[Path, Any]] = []
    known = [fqn for fqn in mappings if fqn in tensors or fqn in values]  # the state's own key order
    for fqn in [*known, *(f for f in [*tensors, *values] if f not in mappings)]:
        path = tuple(mappings.get(fqn, (fqn,)))
        entries.append((path, ChunkedRef(order[fqn]) if fqn in order else values[fqn]))
    structure, leaves = encode(nest(entries))
    if leaves:  # a tensor inside a value DCP handed over as bytes
        raise UnsupportedValueError(leaves[0].path, "a tensor inside a non-tensor value")
    return structure


@dataclass(frozen=True)
class Source:
    """Where the bytes of one stored box of an fqn are: a chunk's blob, or a whole plain tensor."""

    blob: int | None = None  # a chunk of a chunked tensor
    tensor: int | None = None  # a plain tensor (manifest.tensors index)
    numpy: bool = False


@dataclass(frozen=True)
class Flat:
    """A version seen as DCP sees a state: fqn -> tensor boxes or value."""

    tensors: dict[str, tuple[torch.dtype, list[int], list[tuple[list[int], list[int], Source]]]]
    values: dict[str, Any]  # fqn -> value (or a Source for a numpy array stored as a tensor)
    mappings: dict[str, Path]


def flatten(manifest: Manifest) -> Flat:
    """The version's state flattened the way DCP's planners flatten the state they load into."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    where: dict[int, Source] = {}
    shapes: dict[int, tuple[torch.dtype, list[int], list[tuple[list[int], list[int], Source]]]] = {}

    def plain(i: int, is_numpy: bool) -> object:
        entry = manifest.tensors[i]
        meta = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device="meta")
        if is_numpy:
            marker = Source(tensor=i, numpy=True)
            return marker
        where[id(meta)] = Source(tensor=i)
        shapes[id(meta)] = (
            meta.dtype,
            entry.shape,
            [([0] * len(entry.shape), entry.shape, Source(tensor=i))],
        )
        return meta

    def chunked(i: int) -> object:
        entry = manifest.chunked[i]
        meta = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device="meta")
        boxes = [(c.offsets, c.sizes, Source(blob=c.blob)) for c in entry.chunks]
        shapes[id(meta)] = (meta.dtype, entry.shape, boxes)
        return meta

    state = decode(manifest.structure, plain, chunked)
    if not isinstance(state, dict):
        raise UnsupportedValueError(
            "", f"the saved state is a {type(state).__name__}, not a dict: load it with load()"
        )
    planner = DefaultSavePlanner()
    planner.set_up_planner(state)
    tensors, values = {}, {}
    for fqn, value in planner.state_dict.items():
        if isinstance(value, torch.Tensor) and id(value) in shapes:
            tensors[fqn] = shapes[id(value)]
        else:
            values[fqn] = value
    return Flat(tensors, values, dict(planner.mappings))


def chunk_entry(offsets: Iterable[int], sizes: Iterable[int], blob: int) -> ChunkEntry:
    return ChunkEntry(offsets=list(offsets), sizes=list(sizes), blob=blob)


__all__ = ["Flat", "Source", "chunk_entry", "flatten", "nest", "path_text", "sharded_structure"]
