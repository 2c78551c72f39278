"""Human-readable sizes, metrics, epochs and retention reports, shared by the CLI and the Prefect
artifacts (no Prefect import), so that both say the same thing the same way."""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptflow.storage import PrunePlan, VersionInfo

    from ..config import RetentionConfig

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def utc_text(moment: datetime | str | None, *, seconds: bool = True, zone: bool = True) -> str:
    """A moment as ``2026-11-25 12:01:02 UTC``: a datetime (naive ones are taken as UTC) or an ISO
    text (kept as given when it is none); ``seconds=False`` drops the seconds, ``zone=False`` the
    `` UTC``. The one way ckptflow writes a time (run cards, logs, ``ckptflow ls``)."""
    if moment is None:
        return "at an unknown time"
    if isinstance(moment, str):
        try:
            parsed = datetime.fromisoformat(moment)
        except ValueError:
            return moment
        moment = parsed
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    text = moment.strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")
    return f"{text} UTC" if zone else text


def human_size(nbytes: int | float) -> str:
    """``1288490188`` -> ``"1.2 GiB"``; bytes below 1 KiB are shown exactly."""
    size = float(nbytes)
    for unit in _UNITS:
        if abs(size) < 1024 or unit == _UNITS[-1]:
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def metric_value(value: float) -> str:
    """A metric in at most four significant digits: ``0.12345`` -> ``"0.1235"``."""
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def metrics_text(metrics: dict[str, float]) -> str:
    """``{"loss": 0.123, "acc": 0.98}`` -> ``"loss=0.123 acc=0.98"`` (in the order given)."""
    return " ".join(f"{name}={metric_value(value)}" for name, value in metrics.items())


def epoch_text(info: VersionInfo) -> str:
    """A version's epoch as its tables show it: ``3`` for a save at epoch 3's end, ``3 (1,200/4,000)``
    for one 1,200 steps into epoch 3 of 4,000 (``3 (1,200)`` when the epoch's length is unknown);
    ``-`` when it records no epoch."""
    if info.epoch is None:
        return "-"
    steps = info.in_epoch
    if steps is None:
        return str(info.epoch)
    length = info.epoch_steps
    return f"{info.epoch} ({steps:,}/{length:,})" if length is not None else f"{info.epoch} ({steps:,})"


def retention_line(policy: RetentionConfig, plan: PrunePlan, durable_from: int | None = None) -> str:
    """``retention (keep_last=3): removed versions 1, 2; kept 3, 4, 5``, the best by the metric,
    what a tarball held back and what was kept until the durable tier holds it (``durable_from``)."""
    rules = ", ".join(
        f"{name}={value}"
        for name, value in (
            ("keep_last", policy.keep_last),
            ("keep_every", policy.keep_every),
            ("keep_best", policy.keep_best and f"{policy.keep_best} ({policy.best_mode})"),
        )
        if value is not None
    )
    removed = version_ranges(plan.remove)
    line = f"retention ({rules}): removed versions {removed}; kept {version_ranges(plan.remaining)}"
    if policy.keep_best is not None:
        best = ", ".join(map(str, plan.best)) or "none (no version has the metric)"
        line += f"; the best by {policy.keep_best} ({policy.best_mode}): {best}"
    waiting = [v for v in plan.remaining if durable_from is not None and v >= durable_from]
    if policy.keep_undurable and len(waiting) > 1:  # the newest is kept anyway
        line += f"; kept until the durable tier holds them: {version_ranges(waiting)}"
    held = plan.describe_held()
    return f"{line}; kept beyond the policy: {held}" if held else line


def version_ranges(versions: Iterable[int]) -> str:
    """``[1, 2, 3, 5, 7, 8]`` -> ``"1-3, 5, 7-8"``."""
    spans: list[list[int]] = []
    for v in sorted(set(versions)):
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"
