"""The non-tensor structure of a state, as JSON.

A training state is a tree of dicts, lists and tuples whose leaves are tensors,
numpy arrays, numbers, strings, bytes, None and dtypes. :func:`encode` turns it
into a JSON value plus the list of its array leaves (each replaced in the JSON
by a reference to its index); :func:`decode` does the reverse. Nothing here is
pickled, so loading a manifest can never run code.

JSON cannot say everything Python can, so some nodes are tagged objects with a
single key starting with ``$``:

- ``{"$tensor": i}`` / ``{"$ndarray": i}``: the i-th array leaf,
- ``{"$chunked": i}``: the i-th chunked tensor of the manifest (a DTensor saved
  as the shards its ranks held; :class:`ChunkedRef` marks it when encoding),
- ``{"$tuple": [...]}``, ``{"$float": "nan" | "inf" | "-inf"}``,
  ``{"$bytes": base64}``, ``{"$dtype": "float32"}``,
- ``{"$dict": [[key, value], ...]}`` for dicts whose keys are not all strings
  (an optimizer's ``state`` is keyed by ints) or where a key starts with ``$``.

Plain dicts with string keys stay plain JSON objects, so a manifest is easy to
read. Round trip is exact: types (int vs float vs bool, tuple vs list) and key
order are kept.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedValueError
from .dtypes import SUPPORTED, dtype_from_name, dtype_name
from .manifest_checks import MAX_DEPTH, json_depth

Json = Any


@dataclass(frozen=True)
class Leaf:
    """An array found in the state: its key path and the tensor holding its data."""

    path: str
    tensor: torch.Tensor
    is_numpy: bool


@dataclass(frozen=True)
class ChunkedRef:
    """Stands for the ``index``-th chunked tensor in a state being encoded."""

    index: int


def join_path(parent: str, key: object) -> str:
    """Key paths are slash-separated, e.g. ``optimizer/state/0/exp_avg``."""
    return f"{parent}/{key}" if parent else str(key)


def encode(state: object) -> tuple[Json, list[Leaf]]:
    """Split ``state`` into a JSON structure and its array leaves.

    Raises :class:`UnsupportedValueError` naming the key path of the first
    value that cannot be stored; nothing has been written at that point.
    """
    leaves: list[Leaf] = []
    deepest = [0]  # the most containers of the state nested in one another
    try:
        structure = _encode(state, "", leaves, set(), deepest)
        # Each container adds at most 3 levels of JSON ({"$dict": [[key, value]]}) and a leaf 1:
        # only a state nested that deep needs its structure measured.
        depth = json_depth(structure) if 3 * deepest[0] + 1 > MAX_DEPTH else 0
    except RecursionError:
        depth = MAX_DEPTH + 1
    if depth > MAX_DEPTH:  # a reader would refuse it: refuse it now, before anything is written
        raise UnsupportedValueError(
            "", f"the state nests more than the {MAX_DEPTH} levels a checkpoint may hold; flatten it"
        )
    return structure, leaves


def _encode(value: object, path: str, leaves: list[Leaf], active: set[int], deepest: list[int]) -> Json:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _check_text(value, path)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$float": repr(float(value))}
    if isinstance(value, torch.Tensor):
        return {"$tensor": _add_leaf(leaves, path, _check_tensor(value, path), False)}
    if isinstance(value, ChunkedRef):
        return {"$chunked": value.index}
    if isinstance(value, np.ndarray):
        return {"$ndarray": _add_leaf(leaves, path, _numpy_to_tensor(value, path), True)}
    if isinstance(value, np.generic):
        return _encode(value.item(), path, leaves, active, deepest)
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, (dict, list, tuple)):
        if id(value) in active:
            raise UnsupportedValueError(path, "the state contains a reference cycle")
        active.add(id(value))
        deepest[0] = max(deepest[0], len(active))
        try:
            return _encode_container(value, path, leaves, active, deepest)
        finally:
            active.discard(id(value))
    raise UnsupportedValueError(
        path,
        f"values of type {type(value).__qualname__} are not supported; store tensors, "
        "numbers, strings, bytes, None and dicts/lists/tuples of them, or objects with "
        "state_dict() and load_state_dict() (modules, optimizers, schedulers)",
    )


def _encode_container(
    value: dict | list | tuple, path: str, leaves: list[Leaf], active: set[int], deepest: list[int]
) -> Json:
    if isinstance(value, list):
        return [_encode(v, join_path(path, i), leaves, active, deepest) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {
            "$tuple": [_encode(v, join_path(path, i), leaves, active, deepest) for i, v in enumerate(value)]
        }
    if all(isinstance(k, str) and not k.startswith("$") for k in value):
        return {
            _check_text(k, path): _encode(v, join_path(path, k), leaves, active, deepest)
            for k, v in value.items()
        }
    pairs = []
    for k, v in value.items():
        if not isinstance(k, (str, int, float, bool, tuple, type(None))):
            raise UnsupportedValueError(path, f"dict key {k!r} of type {type(k).__qualname__}")
        pairs.append(
            [
                _encode(k, path, leaves, active, deepest),
                _encode(v, join_path(path, k), leaves, active, deepest),
            ]
        )
    return {"$dict": pairs}


def _check_text(text: str, path: str) -> str:
    """Strings must be valid Unicode to be written as JSON (and as HDF5 names)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedValueError(
            path, f"the string {text!r} is not valid Unicode (a lone surrogate)"
        ) from None
    return text


def _add_leaf(leaves: list[Leaf], path: str, tensor: torch.Tensor, is_numpy: bool) -> int:
    leaves.append(Leaf(path, tensor, is_numpy))
    return len(leaves) - 1


def _check_tensor(tensor: torch.Tensor, path: str) -> torch.Tensor:
    if tensor.layout != torch.strided:
        raise UnsupportedValueError(
            path, f"{tensor.layout} tensors are not supported; convert with .to_dense()"
        )
    if tensor.is_quantized:
        raise UnsupportedValueError(
            path, "quantized tensors are not supported; store .dequantize() or int_repr()"
        )
    if tensor.device.type == "meta":
        raise UnsupportedValueError(path, "meta tensors have no data to store")
    if tensor.dtype not in SUPPORTED:
        raise UnsupportedValueError(path, f"tensors of dtype {tensor.dtype} are not supported")
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedValueError(
            path, f"tensor subclass {type(tensor).__qualname__} is not supported; store a plain tensor"
        )
    # A conjugate or negative view's memory holds the values before the sign flip: stored as
    # it is, it would come back as the other value (with a checksum that agrees).
    return tensor.detach().resolve_conj().resolve_neg()


def _numpy_to_tensor(array: np.ndarray, path: str) -> torch.Tensor:
    if array.dtype.hasobject or array.dtype.kind not in "biufc":
        raise UnsupportedValueError(path, f"numpy arrays of dtype {array.dtype} are not supported")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return torch.from_numpy(
        np.ascontiguousarray(array).reshape(array.shape)
    )  # ascontiguousarray makes 0-d 1-d


def decode(
    structure: Json,
    resolve: Callable[[int, bool], object],
    chunked: Callable[[int], object] | None = None,
) -> object:
    """Rebuild a state; ``resolve(index, is_numpy)`` returns the array for a leaf, ``chunked(index)``
    a chunked tensor."""
    if isinstance(structure, list):
        return [decode(v, resolve, chunked) for v in structure]
    if not isinstance(structure, dict):
        return structure
    if len(structure) == 1:
        ((tag, payload),) = structure.items()
        if tag == "$tensor":
            return resolve(payload, False)
        if tag == "$ndarray":
            return resolve(payload, True)
        if tag == "$chunked":
            if chunked is None:
                raise ValueError("a chunked tensor where none was expected")
            return chunked(payload)
        if tag == "$tuple":
            return tuple(decode(v, resolve, chunked) for v in payload)
        if tag == "$float":
            return float(payload)
        if tag == "$bytes":
            return base64.b64decode(payload)
        if tag == "$dtype":
            return dtype_from_name(payload)
        if tag == "$dict":
            return {_key(decode(k, resolve, chunked)): decode(v, resolve, chunked) for k, v in payload}
    return {k: decode(v, resolve, chunked) for k, v in structure.items()}


def _key(key: object) -> object:
    return tuple(key) if isinstance(key, list) else key


def leaf_refs(structure: Json, tags: tuple[str, ...] = ("$tensor", "$ndarray")) -> Iterator[int]:
    """Indices of all array leaves (or of the leaves with ``tags``) referenced below ``structure``."""
    if isinstance(structure, list):
        for v in structure:
            yield from leaf_refs(v, tags)
    elif isinstance(structure, dict):
        if len(structure) == 1:
            ((tag, payload),) = structure.items()
            if tag in tags:
                yield payload
                return
            if tag in ("$tensor", "$ndarray", "$chunked"):
                return
        for v in structure.values():
            yield from leaf_refs(v, tags)


def select(structure: Json, keys: list[str]) -> Json:
    """The part of ``structure`` under the given slash-separated key paths.

    ``select(s, ["model", "optimizer/param_groups"])`` keeps those subtrees
    (and the dicts leading to them) and drops everything else; keys of
    int-keyed dicts stay ints. Raises ``KeyError`` naming a path that does
    not exist.
    """
    result: dict = _empty_like(structure)
    for key in keys:
        _select_one(structure, key.strip("/").split("/"), result, key)
    return result


def _select_one(node: Json, parts: list[str], out: dict, full: str) -> None:
    head, rest = parts[0], parts[1:]
    found = _child(node, head)
    if found is None:
        raise KeyError(f"no key {full!r} in the checkpoint (missing part: {head!r})")
    key, child = found
    if not rest:
        _put(out, key, child)
        return
    sub = _get(out, key)
    if sub is None:
        sub = _empty_like(child)
        _put(out, key, sub)
    if sub is child:  # the whole subtree is already selected
        return
    _select_one(child, rest, sub, full)


def _is_tagged(node: Json, tag: str) -> bool:
    return isinstance(node, dict) and len(node) == 1 and tag in node


def _empty_like(node: Json) -> dict:
    """An empty selection of ``node``: a ``$dict`` for dicts with non-string keys, else a plain dict."""
    return {"$dict": []} if _is_tagged(node, "$dict") else {}


def _get(out: dict, key: Json) -> Json:
    if _is_tagged(out, "$dict"):
        return next((v for k, v in out["$dict"] if k == key), None)
    return out.get(key)


def _put(out: dict, key: Json, value: Json) -> None:
    if _is_tagged(out, "$dict"):
        out["$dict"][:] = [[k, v] for k, v in out["$dict"] if k != key] + [[key, value]]
    else:
        out[str(key)] = value


def _child(node: Json, name: str) -> tuple[Json, Json] | None:
    """``(key, child)`` of ``node`` named ``name`` (the key as stored), or None."""
    if _is_tagged(node, "$dict"):
        for k, v in node["$dict"]:
            if str(k) == name:
                return k, v
        return None
    if _is_tagged(node, "$tuple"):
        node = node["$tuple"]
    if isinstance(node, dict):
        return (name, node[name]) if name in node else None
    if isinstance(node, list) and name.isdigit() and int(name) < len(node):
        return name, node[int(name)]
    return None
