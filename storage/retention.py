"""Retention policy: which committed versions to keep.

Pure functions over the list of committed versions; the store deletes what
they do not keep. The newest committed version is always kept, whatever the
policy says: pruning never takes away the checkpoint a run would resume from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .manifest import Manifest


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the union of: the last ``keep_last``, every ``keep_every``-th epoch, the best by a metric."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: str | None = None
    best_mode: Literal["min", "max"] = "min"
    best_count: int = 1

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.best_count < 1:
            raise ValueError(f"best_count must be >= 1, got {self.best_count}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.keep_last is None and self.keep_every is None and self.keep_best is None:
            raise ValueError("a retention policy needs at least one of keep_last, keep_every, keep_best")


def versions_to_keep(manifests: list[Manifest], policy: RetentionPolicy) -> set[int]:
    """Version numbers the policy keeps, out of ``manifests`` (committed versions)."""
    ordered = sorted(manifests, key=lambda m: m.version)
    if not ordered:
        return set()
    keep = {ordered[-1].version}
    if policy.keep_last:
        keep.update(m.version for m in ordered[-policy.keep_last :])
    if policy.keep_every:
        keep.update(m.version for m in ordered if _epoch(m) % policy.keep_every == 0)
    metric = policy.keep_best
    if metric:
        scored = [m for m in ordered if metric in m.metrics]
        sign = 1 if policy.best_mode == "min" else -1
        scored.sort(key=lambda m: (sign * m.metrics[metric], -m.version))
        keep.update(m.version for m in scored[: policy.best_count])
    return keep


def _epoch(m: Manifest) -> int:
    return m.epoch if m.epoch is not None else m.version
