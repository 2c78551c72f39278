"""Python values that a checkpoint tree cannot hold as they are, turned into ones it can, and back.

Frameworks put hyper-parameters into their checkpoints: Lightning's ``save_hyperparameters``
keeps argparse ``Namespace`` objects, ``pathlib`` paths and whatever else a module was built
with. A store holds trees of tensors, numbers, strings, bytes and containers
(:mod:`..format.structure`). :func:`to_storable` replaces a namespace, a path or a set by a
tagged dict that says what it was, and :func:`from_storable` turns the tag back into the value.

Anything else is refused, naming its key path. Nothing is pickled, and nothing is unpickled: a
pickle runs code when it is read. A pickled value that an earlier ckptflow stored (its
``allow_pickle`` option) is refused on load, naming its key path and type.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedValueError
from ..format.structure import join_path

TAG = "__ckptflow_pyvalue__"
_PATHS = {
    cls.__name__: cls
    for cls in (
        pathlib.PurePath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
        pathlib.Path,
        pathlib.PosixPath,
        pathlib.WindowsPath,
    )
}
_LEAVES = (
    type(None),
    bool,
    int,
    float,
    str,
    bytes,
    bytearray,
    torch.Tensor,
    torch.dtype,
    np.ndarray,
    np.generic,
)


def to_storable(value: Any, *, path: str = "") -> Any:
    """``value`` with every namespace, path and set replaced by a tagged dict (a copy where needed).

    Other objects are refused with :class:`UnsupportedValueError` naming their key path.
    """
    if isinstance(value, _LEAVES):
        return value
    if isinstance(value, dict):
        return {k: to_storable(v, path=join_path(path, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [to_storable(v, path=join_path(path, i)) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, argparse.Namespace):
        return {TAG: "namespace", "value": to_storable(vars(value), path=path)}
    if isinstance(value, pathlib.PurePath) and type(value).__name__ in _PATHS:
        return {TAG: "path", "class": type(value).__name__, "value": str(value)}
    if isinstance(value, (set, frozenset)):
        items = [to_storable(v, path=path) for v in value]
        return {TAG: type(value).__name__, "value": items}
    raise UnsupportedValueError(
        path,
        f"a {_qualname(value)} cannot be stored without pickling it, and ckptflow never pickles: "
        "store it as a dict, string or number instead",
    )


def from_storable(value: Any, *, path: str = "") -> Any:
    """The inverse of :func:`to_storable`; a pickled value (from an earlier ckptflow) is refused."""
    if isinstance(value, list):
        return [from_storable(v, path=join_path(path, i)) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(from_storable(v, path=join_path(path, i)) for i, v in enumerate(value))
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind is None:
        return {k: from_storable(v, path=join_path(path, k)) for k, v in value.items()}
    inner = value.get("value")
    if kind == "namespace" and isinstance(inner, dict):
        return argparse.Namespace(**from_storable(inner, path=path))
    if kind == "path" and isinstance(inner, str) and value.get("class") in _PATHS:
        return _PATHS[value["class"]](inner)
    if kind in ("set", "frozenset") and isinstance(inner, list):
        items = [from_storable(v, path=path) for v in inner]
        return set(items) if kind == "set" else frozenset(items)
    if kind == "pickle":
        raise UnsupportedValueError(
            path,
            f"the checkpoint holds a pickled {value.get('type', 'object')} here (an earlier ckptflow's "
            "allow_pickle), and ckptflow never unpickles: reading it would run code. "
            "CheckpointStore(url).load(version) returns its bytes, to unpickle yourself if you trust "
            "whoever wrote the store",
        )
    raise UnsupportedValueError(path, f"unknown tagged value {kind!r}; written by a newer ckptflow?")


def _qualname(value: object) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"
