"""The training curve: every metric per epoch, drawn as an SVG line chart (no plotting library).

Each metric gets its own panel with its own y-axis (a loss and an accuracy
do not share a scale), epochs on the x-axis. The chart goes into a markdown
artifact as an image with a ``data:`` URL, which the Prefect UI shows inline;
below it, a table of the last epochs' values, for the numbers themselves.

What must hold:

- The image is ``WIDTH`` x ``PANEL`` per metric (the UI lays it out at that size).
- No line crosses a label: the last value is written in a right margin
  beside the plot area, at the height of the line's end; the y range is
  written as tick labels in the left margin.
- A y-axis is log10 when every value is positive and they span at least two
  decades (``LOG_RATIO``), and its panel's title says so; a linear one
  ends on "nice" ticks (1, 2 or 5 x 10^k apart), a log one on powers of ten.
- Epochs with a committed checkpoint are marked on each line (hollow
  circles; ticks on the epoch axis when there are too many to tell apart),
  the best checkpoint's epoch by a filled diamond, which thinning never drops.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterable
from html import escape
from typing import NamedTuple

from .artifacts import cell
from .formatting import metric_value

WIDTH = 640
PANEL = 150  # height of one metric's panel
MARGIN = (56, 64, 26, 22)  # left, right (the last values), top, bottom
COLORS = ("#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777")
GRID = "#e5e7eb"  # the horizontal gridlines
AXIS = "#999"
MAX_PANELS = 6
MAX_POINTS = 400  # per line: a longer run is thinned evenly (first and last epochs kept)
MAX_COMMITTED_MARKERS = 60  # more committed epochs on a line: ticks on the epoch axis instead
LOG_RATIO = 100  # max/min at which a positive metric gets a log axis
MAX_EPOCH_TICKS = 7
TABLE_ROWS = 10
COMMITTED_SYMBOL, TICK_SYMBOL, BEST_SYMBOL = "○", "|", "◆"


def curve_svg(
    history: dict[int, dict[str, float]], *, committed: Iterable[int] = (), best: int | None = None
) -> str:
    """An SVG of each metric (at most ``MAX_PANELS``) against the epoch, one panel per metric;
    ``committed`` epochs and the ``best`` one are marked on every line."""
    return _chart(history, frozenset(committed), best)[0]


def _chart(
    history: dict[int, dict[str, float]], committed: frozenset[int], best: int | None
) -> tuple[str, set[str]]:
    """The SVG and the kinds of marks drawn in it ("committed", "ticks", "best")."""
    epochs = sorted(history)
    names = list(dict.fromkeys(name for e in epochs for name in history[e]))[:MAX_PANELS]
    height = PANEL * max(1, len(names))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
    ]
    marks: set[str] = set()
    for i, name in enumerate(names):
        values = ((e, history[e].get(name, math.nan)) for e in epochs)
        finite = {e: v for e, v in values if math.isfinite(v)}
        shown = dict(_thinned(list(finite.items())))
        if best in finite:  # the best is drawn however long the run
            shown[best] = finite[best]
        color = COLORS[i % len(COLORS)]
        drawn, panel_marks = _panel(
            name, sorted(shown.items()), top=i * PANEL, color=color, committed=committed, best=best
        )
        parts += drawn
        marks |= panel_marks
    parts += _legend(marks, best)
    parts.append("</svg>")
    return "".join(parts), marks


def _thinned(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    if len(points) <= MAX_POINTS:
        return points
    step = (len(points) - 1) / (MAX_POINTS - 1)
    return [points[round(i * step)] for i in range(MAX_POINTS)]


def _panel(
    name: str,
    points: list[tuple[int, float]],
    *,
    top: int,
    color: str,
    committed: frozenset[int],
    best: int | None,
) -> tuple[list[str], set[str]]:
    left, right, pad_top, pad_bottom = MARGIN
    x0, x1 = left, WIDTH - right
    y0, y1 = top + pad_top, top + PANEL - pad_bottom
    out = [f'<text class="title" x="{x0}" y="{top + 15}" font-weight="bold">{escape(name)}</text>']
    axes = [
        f'<line class="axis" x1="{x0}" y1="{y1}" x2="{x1}" y2="{y1}" stroke="{AXIS}"/>',
        f'<line class="axis" x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="{AXIS}"/>',
    ]
    if not points:
        note = f'<text x="{x0 + 8}" y="{(y0 + y1) // 2}" fill="#666">no finite values</text>'
        return [*out, *axes, note], set()
    first, last = points[0][0], points[-1][0]
    low = min(v for _, v in points)
    high = max(v for _, v in points)
    if not math.isfinite(high - low):  # both ends near the float limits: no scale holds them
        note = f'<text x="{x0 + 8}" y="{(y0 + y1) // 2}" fill="#666">values too far apart to plot</text>'
        return [*out, *axes, note], set()
    scale = _y_scale(low, high)

    def x(epoch: int) -> float:
        return x0 + (x1 - x0) * ((epoch - first) / (last - first) if last > first else 0.5)

    def y(value: float) -> float:
        return y1 - (y1 - y0) * scale.where(value)

    if scale.log:  # beside the title, which stays a text of its own (an estimate of its width)
        after = x0 + 7 * len(name) + 8
        out.append(f'<text class="scale" x="{after}" y="{top + 15}" fill="#666">(log scale)</text>')
    for where, label in scale.ticks:
        at = y1 - (y1 - y0) * where
        out += [
            f'<line class="grid" x1="{x0}" y1="{at:.1f}" x2="{x1}" y2="{at:.1f}" stroke="{GRID}"/>',
            f'<text class="ytick" x="{x0 - 4}" y="{at + 4:.1f}" text-anchor="end" fill="#444">'
            f"{escape(label)}</text>",
        ]
    out += axes
    out.append(f'<text x="4" y="{y1 + 15}" fill="#444">epoch</text>')
    for epoch in _epoch_ticks(first, last):
        out += [
            f'<line x1="{x(epoch):.1f}" y1="{y1}" x2="{x(epoch):.1f}" y2="{y1 + 4}" stroke="{AXIS}"/>',
            f'<text class="xtick" x="{x(epoch):.1f}" y="{y1 + 15}" text-anchor="middle" fill="#444">'
            f"{epoch}</text>",
        ]
    path = " ".join(f"{x(e):.1f},{y(v):.1f}" for e, v in points)
    out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
    if len(points) == 1:
        cx, cy = x(first), y(points[0][1])
        out.append(f'<circle class="point" cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{color}"/>')
    marks: set[str] = set()
    kept = [(e, v) for e, v in points if e in committed]
    if len(kept) > MAX_COMMITTED_MARKERS:
        marks.add("ticks")
        out += [
            f'<line class="committed" x1="{x(e):.1f}" y1="{y1 - 5}" x2="{x(e):.1f}" y2="{y1}" '
            f'stroke="{color}"/>'
            for e, _ in kept
        ]
    elif kept:
        marks.add("committed")
        out += [
            f'<circle class="committed" cx="{x(e):.1f}" cy="{y(v):.1f}" r="3.5" fill="white" '
            f'stroke="{color}" stroke-width="1.5"/>'
            for e, v in kept
        ]
    for e, v in points:
        if e == best:
            marks.add("best")
            cx, cy = x(e), y(v)
            corners = " ".join(
                f"{cx + dx:.1f},{cy + dy:.1f}" for dx, dy in ((0, -5), (5, 0), (0, 5), (-5, 0))
            )
            out.append(f'<polygon class="best" points="{corners}" fill="{color}" stroke="#111"/>')
    e, v = points[-1]  # the last value, in the right margin at the line end's height
    label_y = min(max(y(v) + 4, top + 12), top + PANEL - 4)
    label = f'<text class="last" x="{x1 + 8}" y="{label_y:.1f}" fill="{color}">'
    out.append(f"{label}{escape(metric_value(v))}</text>")
    return out, marks


class _Scale(NamedTuple):
    """A y-axis: where a value lies (0 at the bottom, 1 at the top) and its ticks (where, label)."""

    log: bool
    where: Callable[[float], float]
    ticks: list[tuple[float, str]]


def _y_scale(low: float, high: float) -> _Scale:
    """Log10 for positive values spanning ``LOG_RATIO`` or more, linear otherwise (``high - low`` finite)."""
    if low > 0 and high / low >= LOG_RATIO:
        bottom, top, powers = _log_ticks(low, high)
        return _Scale(
            True,
            lambda v: (math.log10(v) - bottom) / (top - bottom),
            [((k - bottom) / (top - bottom), _power_label(k)) for k in powers],
        )
    if high == low:  # a constant: a band around it (towards zero where it is near the float limit)
        pad = 0.5 * abs(low) or 0.5
        low, high = (low - pad, high + pad) if math.isfinite(abs(low) + pad) else (min(low, 0), max(high, 0))
    start, end, ticks = _linear_ticks(low, high)
    return _Scale(
        False,
        lambda v: (v - start) / (end - start),
        [((t - start) / (end - start), metric_value(t)) for t in ticks],
    )


def _linear_ticks(low: float, high: float) -> tuple[float, float, list[float]]:
    """3 to 5 ticks 1, 2 or 5 x 10^k apart, the first at or below ``low``, the last at or above
    ``high``: the axis's range; ``low`` and ``high`` themselves where floats cannot hold such ticks."""
    magnitude = math.floor(math.log10(high - low))
    for exponent in range(magnitude - 1, magnitude + 2):
        for mantissa in (1, 2, 5):
            step = float(f"{mantissa}e{exponent}")  # no OverflowError near the float limits
            if not 0 < step < math.inf:
                continue  # below the smallest float (larger steps follow) or beyond the largest
            first, last = math.floor(low / step), math.ceil(high / step)
            if last - first > 4:
                continue
            ticks = [k * step for k in range(first, last + 1)]
            if len(set(ticks)) < 3 or not math.isfinite(ticks[-1] - ticks[0]):
                return low, high, [low, high]  # a range of a few ulps, or one beyond the largest float
            return min(ticks[0], low), max(ticks[-1], high), ticks
    return low, high, [low, high]


def _log_ticks(low: float, high: float) -> tuple[int, int, list[int]]:
    """The axis's range in decades (whole powers of ten around ``low`` and ``high``) and the powers
    that get a tick: every one, or every n-th for at most 6 ticks."""
    bottom, top = math.floor(math.log10(low)), math.ceil(math.log10(high))
    every = math.ceil((top - bottom) / 5)
    top = bottom + every * math.ceil((top - bottom) / every)
    return bottom, top, list(range(bottom, top + 1, every))


def _power_label(power: int) -> str:
    """10^power as ``metric_value`` writes it (``0.001``, ``1e+05``), without computing what overflows."""
    return metric_value(10.0**power) if abs(power) < 300 else f"1e{power:+03d}"


def _epoch_ticks(first: int, last: int) -> list[int]:
    """At most ``MAX_EPOCH_TICKS`` epochs in ``first..last``, multiples of 1, 2 or 5 x 10^k."""
    step = 1
    for exponent in range(len(str(abs(last - first))) + 2):
        for mantissa in (1, 2, 5):
            step = mantissa * 10**exponent
            start = -(-first // step) * step
            if (last - start) // step + 1 <= MAX_EPOCH_TICKS:
                return list(range(start, last + 1, step))
    return [first, last]


def _legend(marks: set[str], best: int | None) -> list[str]:
    """The marks' key, at the top right of the first panel's plot area; nothing when none is drawn."""
    keys = []
    if "committed" in marks:
        keys.append(f"{COMMITTED_SYMBOL} committed")
    elif "ticks" in marks:
        keys.append(f"{TICK_SYMBOL} committed")
    if "best" in marks:
        keys.append(f"{BEST_SYMBOL} best (epoch {best})")
    if not keys:
        return []
    spans = "".join(f'<tspan dx="{12 if i else 0}">{escape(key)}</tspan>' for i, key in enumerate(keys))
    x = WIDTH - MARGIN[1]
    return [f'<text class="legend" x="{x}" y="15" text-anchor="end" fill="#444">{spans}</text>']


def data_url(svg: str) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()


def curve_markdown(
    history: dict[int, dict[str, float]],
    *,
    title: str,
    committed: Iterable[int] = (),
    best: int | None = None,
) -> str:
    """The curve artifact: a heading, the chart, the best epoch, and the last epochs' values as a table."""
    epochs = sorted(history)
    names = list(dict.fromkeys(name for e in epochs for name in history[e]))
    svg, marks = _chart(history, frozenset(committed), best)
    lines = [f"# {title}", "", f"![training curve]({data_url(svg)})", ""]
    if best is not None:
        marked = f" (marked {BEST_SYMBOL})" if "best" in marks else ""
        lines += [f"Best: epoch {best}{marked}", ""]
    if names:
        shown = epochs[-TABLE_ROWS:]
        lines += [
            f"Last {len(shown)} of {len(epochs)} epochs:",
            "",
            "| epoch | " + " | ".join(cell(n) for n in names) + " |",
            "|---:|" + "---:|" * len(names),
        ]
        for e in shown:
            cells = [metric_value(history[e][n]) if n in history[e] else "" for n in names]
            lines.append(f"| {e} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
