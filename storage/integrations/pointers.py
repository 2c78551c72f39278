"""The pointer files of the Lightning plugin (:mod:`.lightning`), read without Lightning.

A pointer is a small JSON document at a checkpoint path Lightning chose (``last.ckpt``): the
store that holds the checkpoint (``"."``: the pointer's own directory), the version, the path it
was written for and a random token, which the version's manifest carries too. The CLI reads them
where it takes a store (``ckptflow show run1/last.ckpt``), so this module imports no Lightning.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ManifestError
from ..files.location import Location, open_location
from ..versions.metadata import read_json

if TYPE_CHECKING:
    from ..store import CheckpointStore

POINTER_FORMAT = 1  # "path" and "token" were added later: a pointer without them is an earlier one's
SAME_DIR = "."  # a pointer's store when it is the pointer's own directory
SUFFIX = ".ckpt"  # Lightning's checkpoint files: the CLI looks for a pointer only in one of these


@dataclass(frozen=True)
class Pointer:
    """A pointer as read: its store's URL (resolved), the version it names, the path it was written
    for and its token (both None in a pointer an earlier ckptflow wrote)."""

    store_url: str
    version: int
    written_for: str | None
    token: str | None


def read_pointer(path: str, storage_options: dict[str, Any]) -> Pointer | None:
    """The pointer at ``path`` with its store's URL resolved, or None if there is no file;
    CheckpointError if the file is no pointer."""
    loc, name = pointer_location(path, storage_options)
    if loc.fs.isdir(loc.path(name)):
        return None  # a directory named like a checkpoint file (a store at run.ckpt): no pointer
    try:
        pointer = read_json(loc, name)  # None: no file
    except ManifestError:  # not JSON, too big or too deep
        pointer = False
    if pointer is None:
        return None
    if (
        not isinstance(pointer, dict)
        or pointer.get("ckptflow_pointer") != POINTER_FORMAT
        or not isinstance(pointer.get("store"), str)
        or not isinstance(pointer.get("version"), int)
        or not isinstance(pointer.get("path", ""), str)
        or not isinstance(pointer.get("token", ""), str)
    ):
        raise CheckpointError(
            f"{path} is not a ckptflow checkpoint pointer (a small JSON file written by "
            "CkptflowCheckpointIO); load a torch.save checkpoint without the plugin"
        )
    store = directory(path) if pointer["store"] == SAME_DIR else pointer["store"]
    return Pointer(store, pointer["version"], pointer.get("path"), pointer.get("token"))


def lightning_pointer(url: str, storage_options: dict[str, Any] | None) -> Pointer | None:
    """The pointer at ``url`` if it names a Lightning checkpoint file (``*.ckpt``) that exists, else
    None (``url`` is then a store's, as far as pointers go); CheckpointError if it is no pointer."""
    return read_pointer(url, storage_options or {}) if url.endswith(SUFFIX) else None


def check_pointed(pointer: Pointer, path: str, store: CheckpointStore) -> None:
    """Refuse a pointer whose version does not carry its token: copied away from the directory of
    its store, it would name another checkpoint (a pointer without a token is an earlier one's)."""
    if pointer.token is None:
        return
    info = store.find(pointer.version)
    if info is None:
        raise CheckpointError(
            f"{path} names version {pointer.version} of {store.url}, which is not committed "
            "there: it was deleted, or the pointer was copied away from its store"
        )
    if info.user.get("lightning_token") != pointer.token:
        raise CheckpointError(
            f"{path} names version {pointer.version} of {store.url}, which was not saved for "
            "it: the pointer was copied away from its store, or not written by "
            "CkptflowCheckpointIO; copy a checkpoint's directory whole, with its store"
        )


def directory(path: str) -> str:
    return posixpath.dirname(path) or "."


def pointer_location(path: str, storage_options: dict[str, Any]) -> tuple[Location, str]:
    return open_location(directory(path), storage_options), posixpath.basename(path)
