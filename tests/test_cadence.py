"""The one place a run's save points are decided (tasks/cadence.py), used by the flow and the ranks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ckptflow.tasks.cadence import Cadence
from ckptflow.tasks.config import PipelineConfig


@given(every=st.integers(1, 50), before=st.integers(0, 10_000), length=st.integers(0, 200))
def test_a_step_save_falls_due_when_a_multiple_of_its_steps_is_trained(
    every: int, before: int, length: int
) -> None:
    """One step or a whole epoch's: due exactly when a step in (before, before + length] is a multiple."""
    cadence = Cadence(steps=every)
    expected = any(step % every == 0 for step in range(before + 1, before + length + 1))
    assert cadence.steps_due(before, before + length) is expected


def test_without_steps_or_minutes_nothing_falls_due_inside_an_epoch() -> None:
    cadence = Cadence(epochs=2)
    assert not cadence.inside_epochs
    assert not cadence.steps_due(0, 10**6) and not cadence.time_due(10**9)
    assert Cadence(minutes=0.5).inside_epochs and Cadence(steps=3).inside_epochs


def test_a_minute_save_falls_due_once_its_minutes_have_passed() -> None:
    cadence = Cadence(minutes=1.5)
    assert not cadence.time_due(89.9) and cadence.time_due(90.0) and cadence.time_due(500)


def test_an_epoch_end_is_saved_every_n_epochs_at_a_stop_and_when_a_step_save_fell_inside() -> None:
    cadence = Cadence(epochs=3)
    assert [e for e in range(1, 10) if cadence.epoch_end_due(e, stopping=False)] == [3, 6, 9]
    assert cadence.epoch_end_due(4, stopping=True) and cadence.epoch_end_due(4, stopping=False, inside=True)


def test_the_cadence_of_a_run_is_its_configs() -> None:
    config = PipelineConfig(storage="x", save_every=4, save_every_steps=7, save_every_minutes=2.5)
    assert Cadence.of(config) == Cadence(epochs=4, steps=7, minutes=2.5)
