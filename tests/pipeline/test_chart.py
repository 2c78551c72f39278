"""The training-curve SVG, parsed with ElementTree (no Prefect server).

Fixes a user's report on the curve artifact: value labels struck through by
the lines (the last value now lies in a right margin, the range as tick
labels in the left one), a linear axis that flattened a loss falling from
0.42 to 0.0001 (a log10 axis now, said in the panel's title), no gridlines
(light ones at "nice" ticks now; x ticks at nice epochs), and no marks of
the committed checkpoints or the best one (hollow circles, or ticks on the
epoch axis when there are many; a filled diamond and a legend).
"""

from __future__ import annotations

import base64
import itertools
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import pytest

from ckptflow.tasks.reporting.chart import (
    GRID,
    MAX_PANELS,
    MAX_POINTS,
    PANEL,
    WIDTH,
    curve_markdown,
    curve_svg,
)
from ckptflow.tasks.reporting.formatting import metric_value

NS = "{http://www.w3.org/2000/svg}"
EPOCHS = range(1, 31)


def falling_loss() -> dict[int, dict[str, float]]:
    """0.42 at epoch 1 to 0.0001 at epoch 30, evenly in log; exactly 0.001 at epoch 22."""
    ratio = math.log10(1e-4 / 0.42) / 29
    history = {e: {"loss": 0.42 * 10 ** (ratio * (e - 1))} for e in EPOCHS}
    history[22]["loss"], history[30]["loss"] = 0.001, 1e-4
    return history


def rising(low: float, high: float, name: str = "acc") -> dict[int, dict[str, float]]:
    return {e: {name: low + (high - low) * (e - 1) / 29} for e in EPOCHS}


@dataclass
class Panel:
    """The elements of one metric's panel, in document order (from its title to the next title)."""

    elements: list[ET.Element]

    def find(self, tag: str, cls: str | None = None) -> list[ET.Element]:
        return [el for el in self.elements if el.tag == NS + tag and (cls is None or el.get("class") == cls)]

    def texts(self, cls: str | None = None) -> list[str]:
        return ["".join(el.itertext()) for el in self.find("text", cls)]

    @property
    def title(self) -> str:
        """The name and, for a log axis, the note beside it."""
        return " ".join(self.texts("title") + self.texts("scale"))

    @property
    def points(self) -> list[tuple[float, float]]:
        (line,) = self.find("polyline")
        return pairs(line)

    @property
    def plot(self) -> tuple[float, float, float, float]:
        """The plot area (x0, x1, y0, y1) from its two axis lines."""
        bottom, side = self.find("line", "axis")
        return num(bottom, "x1"), num(bottom, "x2"), num(side, "y1"), num(side, "y2")

    def y_ticks(self) -> list[tuple[float, float]]:
        """(value, y of its baseline) of each left tick label, bottom first."""
        return [(float("".join(t.itertext())), num(t, "y")) for t in self.find("text", "ytick")]


def num(el: ET.Element, attribute: str) -> float:
    return float(el.attrib[attribute])


def pairs(el: ET.Element) -> list[tuple[float, float]]:
    """The (x, y) of a polyline's or polygon's points."""
    return [(float(x), float(y)) for x, y in (p.split(",") for p in el.attrib["points"].split())]


def center(el: ET.Element) -> tuple[float, float]:
    corners = pairs(el)
    return sum(x for x, _ in corners) / len(corners), sum(y for _, y in corners) / len(corners)


def legends(svg: str) -> list[str]:
    return ["".join(el.itertext()) for el in parse(svg) if el.get("class") == "legend"]


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == NS + "svg"
    return root


def panels(svg: str) -> list[Panel]:
    found: list[Panel] = []
    for el in parse(svg):
        if el.get("class") == "title":
            found.append(Panel([]))
        if found and el.get("class") != "legend":
            found[-1].elements.append(el)
    return found


def x_of(panel: Panel, epoch: int, epochs: list[int]) -> float:
    """The polyline's x at ``epoch``, ``epochs`` being the panel's drawn epochs in order."""
    return panel.points[epochs.index(epoch)][0]


def is_nice(step: float) -> bool:
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(math.isclose(mantissa, m, rel_tol=1e-6) for m in (1, 2, 5, 10))


class TestSize:
    """The browser test lays the image out at WIDTH x PANEL per metric."""

    def test_width_and_height_per_metric(self):
        history = {e: {"loss": 1 / e, "acc": e / 40, "lr": 0.1} for e in EPOCHS}
        root = parse(curve_svg(history, committed=EPOCHS, best=3))
        assert (root.get("width"), root.get("height")) == (str(WIDTH), str(3 * PANEL))
        assert root.get("viewBox") == f"0 0 {WIDTH} {3 * PANEL}"
        assert len(panels(curve_svg(history))) == 3

    def test_at_most_max_panels(self):
        history = {1: {f"m{i}": float(i) for i in range(MAX_PANELS + 3)}}
        root = parse(curve_svg(history))
        assert root.get("height") == str(MAX_PANELS * PANEL)
        assert len(panels(curve_svg(history))) == MAX_PANELS

    def test_empty_history_is_one_empty_panel(self):
        root = parse(curve_svg({}))
        assert (root.get("width"), root.get("height")) == (str(WIDTH), str(PANEL))
        assert not root.findall(f"{NS}polyline")


class TestLogAxis:
    """A loss falling over decades gets a log10 axis; a metric within one decade stays linear."""

    def test_loss_over_three_decades_is_log(self):
        (panel,) = panels(curve_svg(falling_loss()))
        assert "log scale" in panel.title
        y_milli, y_tenth = panel.points[21][1], panel.points[29][1]  # epochs 22 (0.001) and 30 (0.0001)
        assert y_tenth - y_milli > 0.15 * PANEL  # a linear axis: 0.0009 of 0.42, under 1% of it
        assert panel.texts("ytick") == ["0.0001", "0.001", "0.01", "0.1", "1"]

    def test_log_axis_spaces_decades_evenly(self):
        (panel,) = panels(curve_svg(falling_loss()))
        ys = [y for _, y in panel.y_ticks()]
        gaps = [a - b for a, b in itertools.pairwise(ys)]
        assert all(math.isclose(g, gaps[0], abs_tol=0.2) for g in gaps), gaps
        # epoch 22's 0.001 lies on the 0.001 gridline
        assert math.isclose(panel.points[21][1], ys[1] - 4, abs_tol=0.2)

    def test_title_stays_its_own_text(self):
        """The monitoring test finds each metric as ``>{name}</text>``; a log note must not break it."""
        svg = curve_svg(falling_loss())
        assert ">loss</text>" in svg

    @pytest.mark.parametrize(
        ("low", "high"),
        [(0.5, 0.9), (1.0, 99.0), (-0.42, 0.0001), (0.0, 1000.0)],
        ids=["within-a-decade", "just-under-100x", "negative", "zero"],
    )
    def test_linear_axis(self, low, high):
        (panel,) = panels(curve_svg(rising(low, high)))
        assert "log scale" not in panel.title
        ys = [y for _, y in panel.points]
        steps = [a - b for a, b in itertools.pairwise(ys)]  # equal value steps: equal heights
        assert all(math.isclose(s, steps[0], abs_tol=0.15) for s in steps), steps

    def test_hundred_fold_is_log(self):
        (panel,) = panels(curve_svg(rising(1.0, 100.0)))
        assert "log scale" in panel.title
        assert panel.texts("ytick") == ["1", "10", "100"]

    def test_many_decades_keep_few_ticks(self):
        history = {1: {"x": 1e-300}, 2: {"x": 1e300}, 3: {"x": 5e-324}, 4: {"x": 1.7e308}}
        (panel,) = panels(curve_svg(history))
        assert "log scale" in panel.title
        assert 3 <= len(panel.texts("ytick")) <= 6
        assert len(panel.points) == 4


class TestGridAndTicks:
    """Light gridlines at nice y ticks (1, 2 or 5 x 10^k; powers of ten on a log axis), nice epochs."""

    @pytest.mark.parametrize(
        ("low", "high"),
        [(0.5, 0.9), (0.51, 0.93), (-3.0, 0.3), (1000.0, 1234.0), (0.0, 1e-5), (-250.0, -20.0), (0.2, 7.0)],
    )
    def test_linear_ticks_are_nice_and_hold_the_values(self, low, high):
        (panel,) = panels(curve_svg(rising(low, high)))
        ticks = panel.y_ticks()
        values = [v for v, _ in ticks]
        assert 3 <= len(values) <= 5, values
        steps = [b - a for a, b in itertools.pairwise(values)]
        assert all(math.isclose(s, steps[0], rel_tol=1e-6) for s in steps), values
        assert is_nice(steps[0]), values
        assert all(math.isclose(v / steps[0], round(v / steps[0]), abs_tol=1e-6) for v in values), values
        assert values[0] <= low and values[-1] >= high  # the axis's range is written, no min/max texts
        assert panel.texts("ytick")[0] == metric_value(values[0])
        _, _, y0, y1 = panel.plot
        assert math.isclose(ticks[0][1] - 4, y1, abs_tol=0.2) and math.isclose(
            ticks[-1][1] - 4, y0, abs_tol=0.2
        )

    def test_a_gridline_per_tick(self):
        for panel in panels(curve_svg(falling_loss())) + panels(curve_svg(rising(0.5, 0.9))):
            grid = panel.find("line", "grid")
            assert grid and all(line.get("stroke") == GRID for line in grid)
            assert sorted(num(line, "y1") for line in grid) == sorted(
                round(y - 4, 1) for _, y in panel.y_ticks()
            )
            x0, x1, _, _ = panel.plot
            assert all((num(g, "x1"), num(g, "x2")) == (x0, x1) for g in grid)
            assert all(g.get("y1") == g.get("y2") for g in grid)  # horizontal

    @pytest.mark.parametrize(
        ("first", "last", "expected"),
        [(1, 30, [5, 10, 15, 20, 25, 30]), (0, 300, [0, 50, 100, 150, 200, 250, 300]), (3, 5, [3, 4, 5])],
    )
    def test_epoch_ticks_are_nice(self, first, last, expected):
        epochs = list(range(first, last + 1))
        (panel,) = panels(curve_svg({e: {"loss": 1.0 + e} for e in epochs}))
        assert [int(t) for t in panel.texts("xtick")] == expected
        for tick in panel.find("text", "xtick"):  # under its epoch's point
            x = x_of(panel, int("".join(tick.itertext())), epochs)
            assert math.isclose(num(tick, "x"), x, abs_tol=0.1)

    def test_epoch_ticks_of_a_long_run(self):
        epochs = list(range(7, 123_457))
        (panel,) = panels(curve_svg({e: {"loss": 1.0 / e} for e in epochs}))
        ticks = [int(t) for t in panel.texts("xtick")]
        assert 2 <= len(ticks) <= 7 and ticks[0] >= 7 and ticks[-1] <= 123_456
        steps = {b - a for a, b in itertools.pairwise(ticks)}
        assert len(steps) == 1 and is_nice(steps.pop())


class TestMarks:
    """Committed epochs as hollow circles on every line, the best as a filled diamond, and a legend."""

    def history(self) -> dict[int, dict[str, float]]:
        history = {e: {"loss": 1.0 / e, "acc": e / 20} for e in range(1, 21)}
        history[4]["acc"], history[8]["acc"] = math.nan, math.inf
        return history

    def test_a_circle_per_committed_drawn_point(self):
        committed = {2, 4, 6, 8, 10, 50}  # 50: not in the history; 4 and 8: no finite acc
        loss, acc = panels(curve_svg(self.history(), committed=committed))
        for panel, expected in ((loss, {2, 4, 6, 8, 10}), (acc, {2, 6, 10})):
            circles = panel.find("circle", "committed")
            assert len(circles) == len(expected)
            assert all(c.get("fill") == "white" for c in circles)  # hollow
            centers = {(num(c, "cx"), num(c, "cy")) for c in circles}
            assert centers <= set(panel.points)
        drawn_acc = [e for e in range(1, 21) if e not in (4, 8)]
        assert {num(c, "cx") for c in acc.find("circle", "committed")} == {
            x_of(acc, e, drawn_acc) for e in (2, 6, 10)
        }

    def test_many_committed_epochs_are_ticks_on_the_axis(self):
        epochs = list(range(1, 201))
        committed = range(2, 201, 2)  # 100 > 60
        (panel,) = panels(curve_svg({e: {"loss": 1.0 / e} for e in epochs}, committed=committed))
        assert not panel.find("circle", "committed")
        ticks = panel.find("line", "committed")
        assert len(ticks) == 100
        _, _, _, y1 = panel.plot
        assert all(num(t, "y2") == y1 and num(t, "y1") < y1 for t in ticks)
        assert {num(t, "x1") for t in ticks} == {x_of(panel, e, epochs) for e in committed}
        assert legends(curve_svg({e: {"loss": 1.0 / e} for e in epochs}, committed=committed)) == [
            "| committed"
        ]

    def test_best_marked_on_every_panel(self):
        history = self.history()
        svg = curve_svg(history, committed={7}, best=7)
        drawn = {"loss": list(range(1, 21)), "acc": [e for e in range(1, 21) if e not in (4, 8)]}
        for panel, name in zip(panels(svg), ("loss", "acc"), strict=True):
            (diamond,) = panel.find("polygon", "best")
            cx, cy = center(diamond)
            assert math.isclose(cx, x_of(panel, 7, drawn[name]), abs_tol=0.1)
            assert math.isclose(cy, panel.points[drawn[name].index(7)][1], abs_tol=0.1)
            assert diamond.get("fill") not in (None, "none", "white")  # filled
        assert legends(svg) == ["○ committed◆ best (epoch 7)"]
        (legend,) = [el for el in parse(svg) if el.get("class") == "legend"]
        assert num(legend, "y") < PANEL and legend.get("text-anchor") == "end"  # the first panel
        assert num(legend, "x") <= panels(svg)[0].plot[1]  # clear of the last values' margin

    def test_legend_only_for_what_is_drawn(self):
        history = self.history()
        assert legends(curve_svg(history, best=3)) == ["◆ best (epoch 3)"]
        assert legends(curve_svg(history, committed={1})) == ["○ committed"]
        assert legends(curve_svg(history, committed={99}, best=99)) == []  # neither epoch is in the history
        assert legends(curve_svg(history)) == []

    def test_best_survives_thinning(self):
        epochs = list(range(1, 1001))
        history = {e: {"loss": 1.0 / e} for e in epochs}
        (plain,) = panels(curve_svg(history))
        assert len(plain.points) == MAX_POINTS
        (xa, _), (xb, _) = plain.points[0], plain.points[-1]
        x2 = xa + (xb - xa) * 1 / 999
        assert all(abs(x - x2) > 0.05 for x, _ in plain.points)  # epoch 2 thinned away
        (panel,) = panels(curve_svg(history, best=2))
        assert len(panel.points) == MAX_POINTS + 1
        (diamond,) = panel.find("polygon", "best")
        assert math.isclose(center(diamond)[0], x2, abs_tol=0.1)

    def test_markdown_names_the_best(self):
        history = falling_loss()
        text = curve_markdown(history, title="Training curve of store", committed=[5, 10], best=22)
        image, best_line = re.search(r"(!\[training curve\]\([^)]+\))\n\n(.*)\n", text).groups()
        assert best_line == "Best: epoch 22 (marked ◆)"
        encoded = image.split("base64,")[1].rstrip(")")
        assert base64.b64decode(encoded).decode() == curve_svg(history, committed=[5, 10], best=22)
        assert "Best:" not in curve_markdown(history, title="t")
        assert "Best: epoch 99\n" in curve_markdown(history, title="t", best=99)  # no marker to point at


class TestLabels:
    """No line crosses a label: texts lie in the margins, the last value right of the plot."""

    @pytest.mark.parametrize(
        "history",
        [falling_loss(), rising(0.5, 0.9), rising(0.9, 0.5), {1: {"x": 3.0}, 2: {"x": 3.0}}],
        ids=["falling-log", "rising", "falling", "constant"],
    )
    def test_last_value_right_of_the_plot(self, history):
        (panel,) = panels(curve_svg(history, committed=list(history), best=max(history)))
        (last,) = panel.find("text", "last")
        _, x1, _, _ = panel.plot
        assert num(last, "x") > max(x for x, _ in panel.points) and num(last, "x") > x1
        assert num(last, "x") > max(
            center(panel.find("polygon", "best")[0])[0] + 5, x1
        )  # clear of the marker
        assert last.get("text-anchor", "start") == "start"
        assert math.isclose(num(last, "y") - 4, panel.points[-1][1], abs_tol=0.2)  # at the end's height
        assert 0 < num(last, "y") <= PANEL
        (value,) = history[max(history)].values()
        assert "".join(last.itertext()) == metric_value(value)

    def test_no_text_inside_the_plot_area(self):
        history = {**falling_loss()}
        for e in EPOCHS:
            history[e]["acc"] = 0.5 + 0.4 * e / 30
        for panel in panels(curve_svg(history, committed=range(1, 31, 3), best=22)):
            x0, x1, y0, y1 = panel.plot
            for text in panel.find("text"):
                x, y, anchor = num(text, "x"), num(text, "y"), text.get("text-anchor", "start")
                beside = (anchor == "end" and x <= x0) or (anchor == "start" and x >= x1)
                assert beside or y <= y0 - 6 or y >= y1 + 8, ET.tostring(text)

    def test_text_is_escaped(self):
        name = 'a<b & "c"'
        (panel,) = panels(curve_svg({1: {name: 1.0}, 2: {name: 2.0}}))
        assert panel.texts("title") == [name]


class TestDegenerate:
    """A single point, a constant, non-finite values: still drawn, or a note instead of a line."""

    def test_single_point(self):
        (panel,) = panels(curve_svg({5: {"loss": 0.3}}, committed={5}, best=5))
        assert len(panel.points) == 1
        (dot,) = panel.find("circle", "point")
        x0, x1, y0, y1 = panel.plot
        assert x0 < num(dot, "cx") < x1 and y0 < num(dot, "cy") < y1
        assert len(panel.find("circle", "committed")) == 1 and len(panel.find("polygon", "best")) == 1
        assert panel.texts("xtick") == ["5"]
        assert panel.texts("last") == ["0.3"]

    def test_constant_series(self):
        (panel,) = panels(curve_svg({e: {"lr": 0.001} for e in EPOCHS}))
        ys = {y for _, y in panel.points}
        _, _, y0, y1 = panel.plot
        assert len(ys) == 1 and y0 < ys.pop() < y1
        values = [v for v, _ in panel.y_ticks()]
        assert values[0] < 0.001 < values[-1] and 3 <= len(values) <= 5

    def test_non_finite_values_are_skipped(self):
        history = {e: {"loss": 1.0 / e} for e in EPOCHS}
        history[3]["loss"], history[9]["loss"], history[30]["loss"] = math.nan, math.inf, -math.inf
        (panel,) = panels(curve_svg(history))
        assert len(panel.points) == 27
        assert panel.texts("last") == [metric_value(1.0 / 29)]  # the last finite value
        assert all(math.isfinite(c) for point in panel.points for c in point)

    def test_notes_instead_of_a_line(self):
        history = {
            1: {"nan": math.nan, "far": -1e308, "ok": 1.0},
            2: {"nan": math.inf, "far": 1e308, "ok": 2.0},
        }
        nan, far, ok = panels(curve_svg(history))
        assert not nan.find("polyline") and "no finite values" in nan.texts()
        assert not far.find("polyline") and "values too far apart to plot" in far.texts()
        assert len(ok.points) == 2

    def test_table_unchanged(self):
        history = {e: {"loss": 1.0 / e, "acc": e / 40} for e in EPOCHS}
        text = curve_markdown(history, title="t", committed=EPOCHS, best=30)
        assert "Last 10 of 30 epochs:" in text
        assert "| epoch | loss | acc |" in text
        for e in range(21, 31):
            assert f"| {e} | {metric_value(1.0 / e)} | {metric_value(e / 40)} |" in text
        assert "| 20 |" not in text
