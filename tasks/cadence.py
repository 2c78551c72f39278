"""When a run saves: the one place that decides a save point.

A run saves at the end of every ``save_every``-th epoch, after every
``save_every_steps``-th optimizer step (counted over the whole run), once
``save_every_minutes`` have passed since the last save started, and whenever it
stops (its last epoch, an early stop, SIGTERM, a cancellation). The flow asks at
an epoch's end, the ranks after each step; a spec that trains whole epochs asks
once per epoch whether a step save fell due inside it. Everything here is pure:
the ranks, which import no Prefect, and the flow use the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import PipelineConfig


@dataclass(frozen=True)
class Cadence:
    """A run's save points (see the module's docstring)."""

    epochs: int = 1
    steps: int | None = None
    minutes: float | None = None

    @classmethod
    def of(cls, config: PipelineConfig) -> Cadence:
        return cls(epochs=config.save_every, steps=config.save_every_steps, minutes=config.save_every_minutes)

    @property
    def inside_epochs(self) -> bool:
        """Whether saves may fall due inside an epoch (by steps or by minutes)."""
        return bool(self.steps or self.minutes)

    def steps_due(self, before: int, after: int) -> bool:
        """Whether a step save falls due in the steps after ``before`` up to ``after`` (run totals):
        one step (``after = before + 1``) or a whole epoch's."""
        return self.steps is not None and after // self.steps > before // self.steps

    def time_due(self, elapsed: float) -> bool:
        """Whether a minute save is due ``elapsed`` seconds after the last save started."""
        return self.minutes is not None and elapsed >= self.minutes * 60

    def epoch_end_due(self, epoch: int, *, stopping: bool, inside: bool = False) -> bool:
        """Whether the end of ``epoch`` is saved: every ``epochs``-th, at a stop, or when a step or
        minute save fell due inside it (``inside``: a spec that trains whole epochs)."""
        return epoch % self.epochs == 0 or stopping or inside
