"""Python values that a checkpoint tree cannot hold as they are, turned into ones it can, and back.

Frameworks put hyper-parameters into their checkpoints: Lightning's ``save_hyperparameters``
keeps argparse ``Namespace`` objects, ``pathlib`` paths and whatever else a module was built
with. A store holds trees of tensors, numbers, strings, bytes and containers
(:mod:`..format.structure`). :func:`to_storable` replaces a namespace, a path or a set by a
tagged dict that says what it was, and :func:`from_storable` turns the tag back into the value.

Under the keys given as ``omit_under`` (Lightning's hyper-parameters), a dataclass is stored as
its fields and comes back as a namespace of them (attribute access, as on the dataclass; no
class named in a checkpoint is ever imported).

Anything else is refused, naming its key path, except under those keys: there it is left
out, with a warning, and recorded as left out
(its type), so that a fit whose module was built with a loss module or an enum does not fail at
its first checkpoint; a load gives the dict without that key (Lightning's ``load_from_checkpoint``
then takes it as a keyword argument). Nothing is pickled, and nothing is unpickled: a pickle
runs code when it is read. A pickled value that an earlier ckptflow stored (its
``allow_pickle`` option) is refused on load, naming its key path and type.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedValueError
from .structure import join_path

log = logging.getLogger(__name__)

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
# The classes besides plain values that a checkpoint of another tool may hold and
# :func:`to_storable` stores: what ``torch.load(weights_only=True)`` may build for an import.
SAFE_CLASSES = (argparse.Namespace, *_PATHS.values())
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


def to_storable(value: Any, *, path: str = "", omit_under: tuple[str, ...] = ()) -> Any:
    """``value`` with every namespace, path, set and dataclass replaced by a tagged dict (a copy
    where needed).

    Other objects are refused with :class:`UnsupportedValueError` naming their key path, or, under
    a top-level key of ``omit_under``, left out with a warning (see the module note).
    """
    if isinstance(value, _LEAVES):
        return value
    if isinstance(value, dict):
        return {k: to_storable(v, path=join_path(path, k), omit_under=omit_under) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [to_storable(v, path=join_path(path, i), omit_under=omit_under) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, argparse.Namespace):
        return {TAG: "namespace", "value": to_storable(vars(value), path=path, omit_under=omit_under)}
    if isinstance(value, pathlib.PurePath) and type(value).__name__ in _PATHS:
        return {TAG: "path", "class": type(value).__name__, "value": str(value)}
    if isinstance(value, (set, frozenset)):
        items = [to_storable(v, path=path, omit_under=omit_under) for v in value]
        return {TAG: type(value).__name__, "value": items}
    under = path.split("/", 1)[0] in omit_under
    if under and dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        stored = to_storable(fields, path=path, omit_under=omit_under)
        return {TAG: "dataclass", "class": _qualname(value), "value": stored}
    if under:
        if path not in _WARNED:
            _WARNED.add(path)
            name = path.rsplit("/", 1)[-1]
            log.warning(
                "%s: a %s is not stored (it cannot be without pickling, and ckptflow never pickles); "
                "the checkpoint records that it was left out. Give it when loading "
                "(load_from_checkpoint(..., %s=...)), or leave it out of the hyper-parameters "
                "(save_hyperparameters(ignore=[%r]))",
                path,
                _qualname(value),
                name,
                name,
            )
        return {TAG: "omitted", "type": _qualname(value)}
    raise UnsupportedValueError(
        path,
        f"a {_qualname(value)} cannot be stored without pickling it, and ckptflow never pickles: "
        "store it as a dict, string or number instead",
    )


_WARNED: set[str] = set()  # key paths left out already, warned of once per process


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
        return {k: from_storable(v, path=join_path(path, k)) for k, v in value.items() if not _omitted(v)}
    inner = value.get("value")
    if kind in ("namespace", "dataclass") and isinstance(inner, dict):
        return argparse.Namespace(**from_storable(inner, path=path))
    if kind == "omitted":
        return None  # (in a list or tuple: its place is kept; a dict leaves the key out)
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


def _omitted(value: Any) -> bool:
    return isinstance(value, dict) and value.get(TAG) == "omitted"


def _qualname(value: object) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"
