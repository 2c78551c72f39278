"""The training curve: every metric per epoch, drawn as an SVG line chart (no plotting library).

Each metric gets its own panel with its own y-axis (a loss and an accuracy
do not share a scale), epochs on the x-axis, the last value written beside
the line. The chart goes into a markdown artifact as an image with a
``data:`` URL, which the Prefect UI shows inline; below it, a table of the
last epochs' values, for the numbers themselves.
"""

from __future__ import annotations

import base64
import math
from html import escape

from .artifacts import cell
from .formatting import metric_value

WIDTH = 640
PANEL = 150  # height of one metric's panel
MARGIN = (56, 16, 26, 22)  # left, right, top, bottom
COLORS = ("#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777")
MAX_PANELS = 6
MAX_POINTS = 400  # per line: a longer run is thinned evenly (first and last epochs kept)
TABLE_ROWS = 10


def curve_svg(history: dict[int, dict[str, float]]) -> str:
    """An SVG of each metric (at most ``MAX_PANELS``) against the epoch, one panel per metric."""
    epochs = sorted(history)
    names = list(dict.fromkeys(name for e in epochs for name in history[e]))[:MAX_PANELS]
    height = PANEL * max(1, len(names))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
    ]
    for i, name in enumerate(names):
        values = [(e, history[e].get(name, math.nan)) for e in epochs]
        points = [(e, v) for e, v in values if math.isfinite(v)]
        parts += _panel(name, _thinned(points), top=i * PANEL, color=COLORS[i % len(COLORS)])
    parts.append("</svg>")
    return "".join(parts)


def _thinned(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    if len(points) <= MAX_POINTS:
        return points
    step = (len(points) - 1) / (MAX_POINTS - 1)
    return [points[round(i * step)] for i in range(MAX_POINTS)]


def _panel(name: str, points: list[tuple[int, float]], *, top: int, color: str) -> list[str]:
    left, right, pad_top, pad_bottom = MARGIN
    x0, x1 = left, WIDTH - right
    y0, y1 = top + pad_top, top + PANEL - pad_bottom
    out = [
        f'<text x="{x0}" y="{top + 15}" font-weight="bold">{escape(name)}</text>',
        f'<line x1="{x0}" y1="{y1}" x2="{x1}" y2="{y1}" stroke="#999"/>',
        f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="#999"/>',
    ]
    if not points:
        return [*out, f'<text x="{x0 + 8}" y="{(y0 + y1) // 2}" fill="#666">no finite values</text>']
    first, last = points[0][0], points[-1][0]
    low = min(v for _, v in points)
    high = max(v for _, v in points)
    if not math.isfinite(high - low):  # both ends near the float limits: no scale holds them
        return [
            *out,
            f'<text x="{x0 + 8}" y="{(y0 + y1) // 2}" fill="#666">values too far apart to plot</text>',
        ]
    if high == low:
        low, high = low - 0.5 * (abs(low) or 1), high + 0.5 * (abs(high) or 1)

    def x(epoch: int) -> float:
        return x0 + (x1 - x0) * ((epoch - first) / (last - first) if last > first else 0.5)

    def y(value: float) -> float:
        return y1 - (y1 - y0) * (value - low) / (high - low)

    path = " ".join(f"{x(e):.1f},{y(v):.1f}" for e, v in points)
    out += [
        f'<text x="{x0 - 4}" y="{y0 + 4}" text-anchor="end" fill="#444">{metric_value(high)}</text>',
        f'<text x="{x0 - 4}" y="{y1}" text-anchor="end" fill="#444">{metric_value(low)}</text>',
        f'<text x="{x0}" y="{y1 + 14}" fill="#444">epoch {first}</text>',
        f'<text x="{x1}" y="{y1 + 14}" text-anchor="end" fill="#444">epoch {last}</text>',
        f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>',
    ]
    if len(points) == 1:
        out.append(f'<circle cx="{x(first):.1f}" cy="{y(points[0][1]):.1f}" r="3" fill="{color}"/>')
    e, v = points[-1]  # the last value, left of the line's end: above it, or below at the top
    label_x, label_y = x(e) - 4, y(v) - 8 if y(v) - 8 > y0 + 10 else y(v) + 16
    label = f'<text x="{label_x:.1f}" y="{label_y:.1f}" text-anchor="end" fill="{color}">'
    out.append(f"{label}{metric_value(v)}</text>")
    return out


def data_url(svg: str) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()


def curve_markdown(history: dict[int, dict[str, float]], *, title: str) -> str:
    """The curve artifact: a heading, the chart, and the last epochs' values as a table."""
    epochs = sorted(history)
    names = list(dict.fromkeys(name for e in epochs for name in history[e]))
    lines = [f"# {title}", "", f"![training curve]({data_url(curve_svg(history))})", ""]
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
