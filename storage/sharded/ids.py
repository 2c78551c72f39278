"""What a DCP ``checkpoint_id`` means to a store: one of its versions.

``dcp.save(state, checkpoint_id=X, storage_writer=store.dcp_writer())`` and ``dcp.load`` hand
``X`` to the writer's or reader's ``reset``. DCP's own filesystem writers take it as the folder of
the checkpoint; a store numbers its versions, so ``X`` may name one: a number (``3``, ``"3"``), a
version directory's name (``"v000003"``) or its path or URL inside the store
(``"ckpt/run1/v000003"``). Anything else, a folder of its own (``"ckpt/step_100"``), is refused
rather than ignored: a load that ignored it would return another version than the one named.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError
from ..files.location import Location
from ..format.names import parse_version_dir, version_dir


def checkpoint_version(checkpoint_id: Any, loc: Location) -> int:
    """The version of the store at ``loc`` that ``checkpoint_id`` names; CheckpointError if none."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool) and checkpoint_id >= 0:
        return checkpoint_id
    if isinstance(checkpoint_id, (str, os.PathLike)):
        text = os.fspath(checkpoint_id)
        if isinstance(text, str):
            if text.isascii() and text.isdigit():
                return int(text)
            number = parse_version_dir(text)
            head, _, _ = text.rstrip("/").rpartition("/")
            if number is not None and (not head or _same_place(head, loc)):
                return number
    raise CheckpointError(
        f"checkpoint_id {checkpoint_id!r} names no version of {loc.display()}: a store numbers its "
        f"versions itself; give a version number (checkpoint_id=3), its directory "
        f"({loc.display(version_dir(3))}), or no checkpoint_id (the next number on a save, "
        "the newest version on a load, or store.dcp_reader(version=N))"
    )


def _same_place(path: str, loc: Location) -> bool:
    """Whether ``path`` (a path or URL) is the store's root."""
    try:
        inside = type(loc.fs)._strip_protocol(path).rstrip("/")
    except Exception:
        return False
    if loc.is_local:
        return os.path.realpath(inside) == os.path.realpath(loc.root)
    return bool(inside == loc.root.rstrip("/"))
