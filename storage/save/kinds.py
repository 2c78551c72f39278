"""Which states DCP must plan: those that hold a DTensor or a DCP ``Stateful`` object.

A store routes a save or a load through DCP (:mod:`..sharded.dcp_calls`) only for these; every other
state takes the store's own planner. Nothing here imports torch.distributed: a plain save must
not pay for importing torch.distributed.checkpoint (0.7 s here).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator


def holds_sharded(state: object) -> bool:
    """Whether ``state`` holds a DTensor or a DCP ``Stateful`` object (anything DCP must plan).

    A process that never imported ``torch.distributed.tensor`` has no DTensor.
    """
    tensor = sys.modules.get("torch.distributed.tensor")
    dtensor = tensor.DTensor if tensor is not None else None
    for value in leaves(state):
        if (dtensor is not None and isinstance(value, dtensor)) or is_stateful(value):
            return True
    return False


def is_stateful(value: object) -> bool:
    """What DCP's ``Stateful`` protocol checks: ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def leaves(state: object) -> Iterator[object]:
    """The leaves of ``state``'s dicts, lists and tuples (without recursion: any depth)."""
    seen: set[int] = set()
    stack = [state]
    while stack:
        node = stack.pop()
        if not isinstance(node, (dict, list, tuple)):
            yield node
        elif id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.values() if isinstance(node, dict) else node)


__all__ = ["holds_sharded", "is_stateful", "leaves"]
