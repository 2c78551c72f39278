"""What a URL that holds no store points at instead: a version directory of a store, or stores below it.

Paths are completed by habit one level too deep (``store/v000003``) or
stopped one level too high (``checkpoints/``, which holds a store per run).
Both exist, so a store opened there finds no versions and would report an
empty store. :func:`misplaced` tells these two cases apart from a real store
(empty or not), so that a command names where the store is instead.

What always holds: a location holding anything a store holds (a version
directory, ``latest``, ``archive/``, the lease, ``run.json``, ``store.json``) is a store and
is never reported as misplaced, and nothing here reads a file or writes
anything: one listing of the location, then, only when it holds none of
those and is no version directory (named ``vNNNNNN`` or holding a
``manifest.json``), one listing of each of its first subdirectories.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..format.manifest import MANIFEST_FILE
from ..format.names import (
    ARCHIVE_DIR,
    FAST_TIER_FILE,
    LATEST_FILE,
    LEASE_FILE,
    RUN_FILE,
    STORE_FILE,
    is_set_aside_dir,
    parse_version_dir,
)
from .location import Location

STORE_FILES = frozenset({LATEST_FILE, ARCHIVE_DIR, LEASE_FILE, RUN_FILE, STORE_FILE, FAST_TIER_FILE})
MAX_CHILDREN = 100  # subdirectories looked into for stores (a directory of many runs: the first, by name)


@dataclass(frozen=True)
class VersionDirectory:
    """The location is one version's directory; ``store`` is the URL of the store that holds it."""

    store: str
    version: int | None  # None: a directory with a manifest but not named as a version


@dataclass(frozen=True)
class StoresBelow:
    """The location holds no store, but its subdirectories ``stores`` (URLs) are stores."""

    stores: tuple[str, ...]


def misplaced(loc: Location) -> VersionDirectory | StoresBelow | None:
    """What ``loc`` is instead of a store; None when it is a store (or nothing this can tell)."""
    names = _names(loc, loc.root)
    if names is None or _holds_a_store(names):
        return None
    own = loc.root.rstrip("/").rsplit("/", 1)[-1]
    version = parse_version_dir(own)
    if version is not None or MANIFEST_FILE in names:
        return VersionDirectory(store=_parent_url(loc), version=version)
    stores = []
    for name in sorted(n for n, is_dir in names.items() if is_dir)[:MAX_CHILDREN]:
        below = _names(loc, loc.path(name))
        if below is not None and _holds_a_store(below):
            stores.append(loc.display(name))
    return StoresBelow(tuple(stores)) if stores else None


def _holds_a_store(names: dict[str, bool]) -> bool:
    return any(
        name in STORE_FILES or parse_version_dir(name) is not None or is_set_aside_dir(name) for name in names
    )


def _names(loc: Location, path: str) -> dict[str, bool] | None:
    """The entries directly in ``path``: name -> whether it is a directory; None if it cannot be listed."""
    try:
        entries = loc.fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    names = {}
    for entry in entries:
        name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
        if name and str(entry["name"]).rstrip("/") != path.rstrip("/"):
            names[name] = entry.get("type") == "directory"
    return names


def _parent_url(loc: Location) -> str:
    """The URL of the directory above ``loc`` (without credentials)."""
    head = loc.display().rpartition("/")[0]
    return head if head and not head.endswith(("/", ":")) else f"{head}/"


def store_holding(path: str | os.PathLike[str]) -> str | None:
    """The local store that ``path`` is, or lies inside, if any: the nearest directory at or above
    it (symbolic links resolved) that holds what a store holds. What is written there would be
    taken for a store's file (a leftover, or part of a version): restore and extract write
    elsewhere. One listing of each directory on the way up; a directory that cannot be listed
    holds no store."""
    here = os.path.realpath(os.fspath(path))
    while True:
        try:
            with os.scandir(here) as entries:
                names = {e.name: e.is_dir(follow_symlinks=False) for e in entries}
        except OSError:  # not there yet, a file, or unreadable
            names = None
        if names is not None and _holds_a_store(names):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent
