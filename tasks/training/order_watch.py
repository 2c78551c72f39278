"""The one data-order trap ckptflow can see: a loader's generator kept in ``extras``.

A spec that trains by steps and shuffles with ``DataLoader(shuffle=True,
generator=g)``, ``g`` in ``Trainable.extras``, resumes inside an epoch in another
order: the loader drew the epoch's order from ``g`` when the epoch began, the
checkpoint holds ``g`` as it was after that draw, and the resumed epoch draws its
order again from there. Every step after the resume then trains on other batches.

What gives it away, without reading the spec's code: a generator in ``extras``
whose state moved when the epoch began (before its first step), did not move
between its first and second steps (a shuffle, not a per-step draw such as
dropout's), and was never seeded again (``initial_seed`` as at build: a spec that
re-seeds it from ``(seed, epoch)`` each epoch resumes exactly). A generator that a
``StatefulDataLoader`` in ``extras`` uses is not watched: that loader restores
its own position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..spec import Trainable

TRAP_TEXT = "drew this epoch's order"  # ckptflow check recognises the warning by it


class OrderWatch:
    """Watches the generators of a spec's ``extras`` over an epoch's first steps (see the module)."""

    def __init__(self, trainable: Trainable) -> None:
        self._generators = _watched(trainable)
        self._seeds = {name: g.initial_seed() for name, g in self._generators.items()}
        self._states: list[dict[str, torch.Tensor]] = []  # before the epoch's first step, after it, ...
        self.warned = False

    def epoch_begins(self) -> None:
        self._states = [self._now()] if self._generators and not self.warned else []

    def stepped(self) -> None:
        if 0 < len(self._states) < 3:
            self._states.append(self._now())

    def trap(self, spec: object) -> str | None:
        """The warning to give once, at a save, if a generator shows the trap (None: none, yet)."""
        if self.warned or len(self._states) < 3:
            return None
        before, first, second = self._states[:3]
        for name, generator in self._generators.items():
            drew_at_start = not _equal(before[name], first[name])
            per_step = not _equal(first[name], second[name])
            seeded_again = generator.initial_seed() != self._seeds[name]
            if drew_at_start and not per_step and not seeded_again:
                self.warned = True
                return (
                    f"{type(spec).__name__} keeps the generator extras[{name!r}], which drew this epoch's "
                    "order when the epoch began: a checkpoint inside the epoch holds it after that draw, so "
                    "a resume there draws another order and the rest of the epoch trains on other batches "
                    "(not bitwise). Make the order from (seed, epoch) each epoch "
                    "(ckptflow.tasks.spec.epoch_generator), or put a torchdata StatefulDataLoader in "
                    "extras; `ckptflow check` shows what differs"
                )
        return None

    def _now(self) -> dict[str, torch.Tensor]:
        return {name: g.get_state() for name, g in self._generators.items()}


def _watched(trainable: Trainable) -> dict[str, Any]:
    import torch

    extras = trainable.extras or {}
    resumable = {
        id(getattr(v, "generator", None)) for v in extras.values() if callable(getattr(v, "state_dict", None))
    }  # a loader in extras restores its own position
    generators = {str(name): v for name, v in extras.items() if isinstance(v, torch.Generator)}
    return {name: g for name, g in generators.items() if id(g) not in resumable}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return bool(torch.equal(a, b))
