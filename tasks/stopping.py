"""Stop conditions, as a small pure state machine fed with each epoch's metrics.

Like the epoch limiter of caffe2's job runner, but with the conditions ML
engineers ask for: the epoch budget, a target value of a metric, no
improvement for P epochs, and a wall-clock budget. Cancellation from Prefect
is checked by the flow; it is not a metric.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .config import StopConfig

SIGTERM_STOP = "stopped by SIGTERM"  # why a run ended early: its process was told to stop
CANCELLED = "cancelled from Prefect"

_signals: list[int] = []  # the signals that stopped a run of this process, in order


def note_stop_signal(signum: int) -> None:
    """Record that a run of this process was stopped by ``signum`` (after saving where it stood):
    ``ckptflow run`` exits 128 + that number."""
    _signals.append(int(signum))


def stop_signal() -> int | None:
    """The signal that last stopped a run of this process, if one did."""
    return _signals[-1] if _signals else None


@dataclass
class StopTracker:
    config: StopConfig
    max_epochs: int
    started: float = field(default_factory=time.monotonic)
    best: float | None = None
    best_epoch: int | None = None

    def seed(self, history: dict[int, dict[str, float]]) -> None:
        """Replay the metrics of epochs committed before a resume."""
        for epoch in sorted(history):
            self._observe(epoch, history[epoch])

    def update(self, epoch: int, metrics: dict[str, float]) -> str | None:
        """Record an epoch; return why training should stop now, or None."""
        self._observe(epoch, metrics)
        c = self.config
        value = metrics.get(c.metric) if c.metric else None
        if c.metric and c.target is not None and value is not None and self._reached(value, c.target):
            return f"{c.metric}={value:.6g} reached the target {c.target:g}"
        if c.patience is not None and self.best_epoch is not None and epoch - self.best_epoch >= c.patience:
            return f"no improvement of {c.metric} for {epoch - self.best_epoch} epochs (best {self.best:.6g})"
        if c.max_seconds is not None and time.monotonic() - self.started >= c.max_seconds:
            return f"the wall-clock budget of {c.max_seconds:g}s is spent"
        if epoch >= self.max_epochs:
            return f"reached epoch {self.max_epochs}"
        return None

    def _observe(self, epoch: int, metrics: dict[str, float]) -> None:
        if not self.config.metric or self.config.metric not in metrics:
            return
        value = metrics[self.config.metric]
        if self.best is None or self._better(value, self.best):
            self.best, self.best_epoch = value, epoch

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.config.mode == "min" else a > b

    def _reached(self, value: float, target: float) -> bool:
        return value <= target if self.config.mode == "min" else value >= target
