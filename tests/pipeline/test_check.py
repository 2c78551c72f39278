"""``ckptflow check`` (tasks/training/check.py): it proves a spec resumes bitwise, or names what differs.

Real training processes, real stops (the processes end) and real resumes from a store, at 1 and
2 processes. The specs are tests/pipeline/check_specs.py (the habits users write), the README's step
specs as written, and the demo's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptflow.tasks.training.check import Position, check_resume
from ckptflow.tasks.training.order_watch import TRAP_TEXT
from tests.clirun import assert_prefect_never_started, ckptflow  # noqa: F401 (the fixture)
from tests.pipeline.helpers import readme_module

REPO = Path(__file__).resolve().parents[2]
SPECS = "tests.pipeline.check_specs"
HABITS_MARKER = "<!-- tests/pipeline/test_check.py checks the next code block with ckptflow check, at 1 and 2 processes -->"  # noqa: E501
MINUTE = 60.0  # "in under a minute each on this machine"


def on_path() -> dict[str, str]:
    """The environment of a CLI run whose spec module lives in this repository."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def test_a_spec_resumed_in_another_data_order_fails_naming_the_leaves_the_step_and_the_cause(ckptflow):  # noqa: F811
    """The user's habit: DataLoader(shuffle=True, generator=g), g in extras, start batches skipped."""
    result = ckptflow("check", "--spec", f"{SPECS}:ShuffledLoaderSpec", "--draw", "1", env=on_path())
    assert result.returncode == 1, result.stderr[-3000:]
    out = result.stdout
    assert "FAIL:" in out and "leaves of the final state differ" in out, out
    assert "model/0.weight" in out and "optimizer/state/0/exp_avg" in out, out
    assert "first difference at step 6 (step 6 of epoch 1)" in out, out  # the first step after the stop at 5
    assert "likely cause:" in out and "generator kept in Trainable.extras" in out, out
    assert "epoch_generator" in out and "StatefulDataLoader" in out, out  # the two ways that work
    assert TRAP_TEXT in result.stderr, result.stderr  # the run's own warning, at its first save
    assert "Traceback" not in result.stderr
    assert result.seconds < MINUTE, result.seconds
    assert_prefect_never_started(ckptflow, result)


def test_a_spec_that_resumes_bitwise_passes_and_exits_0_with_its_report_as_json(ckptflow):  # noqa: F811
    result = ckptflow(
        "check", "--spec", f"{SPECS}:ReseededLoaderSpec", "--draw", "2", "--json", env=on_path()
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["passed"] is True and report["differences"] == [] and report["first"] is None
    stops = report["stops"]
    assert len(stops) == 2 and stops[0]["in_epoch"] and stops[1]["epoch"] == 1, stops  # epoch 1, then 2
    assert report["trained"] == {"epoch": 2, "in_epoch": 0, "step": 40}
    assert report["leaves"] > 600 and report["warnings"] == []
    assert result.seconds < MINUTE, result.seconds


@pytest.mark.parametrize("spec", ["ShuffledLoaderSpec", "ReseededLoaderSpec"])
def test_two_processes_fail_the_trap_and_pass_the_way_that_works(spec: str) -> None:
    report = check_resume(f"{SPECS}:{spec}", nproc=2, draw=3)
    assert report.world_size == 2 and report.seconds < MINUTE, report.text()
    if spec == "ShuffledLoaderSpec":
        assert not report.passed and "model/0.weight" in report.differences, report.text()
        assert report.first is not None and report.first.step == report.stops[0].step + 1, report.text()
        assert report.trap_warned, report.warnings
    else:
        assert report.passed, report.text()
        assert report.leaves > 1200  # both ranks' own states are compared too


def test_a_sum_left_out_of_the_spec_s_state_dict_is_named_as_the_cause() -> None:
    report = check_resume(f"{SPECS}:ForgetfulSpec", draw=1)
    assert not report.passed and report.differences == ["metrics/loss"], report.text()
    assert report.cause is not None and "state_dict()" in report.cause, report.cause


@pytest.mark.parametrize("miscount", [False, True])
def test_accumulated_steps_resume_when_start_counts_optimizer_steps(miscount: bool) -> None:
    report = check_resume(f"{SPECS}:AccumulatingSpec", {"skip_batches": miscount}, draw=1)
    assert report.passed is not miscount, report.text()
    if miscount:
        assert report.first is not None and report.first.step == report.stops[0].step + 1
        assert "skipped the wrong number of batches" in (report.cause or ""), report.cause


def test_a_nondeterministic_spec_is_told_so_before_any_resume_is_blamed() -> None:
    report = check_resume(f"{SPECS}:UnseededSpec", draw=1)
    assert not report.passed, report.text()
    assert report.first is not None and report.first.step <= report.stops[0].step, report.text()
    assert "not deterministic" in (report.cause or ""), report.cause


@pytest.mark.parametrize(
    "spec", ["ReseededLoaderSpec", "ReseededExtrasSpec", "DropoutGeneratorSpec", "ShuffledLoaderSpec"]
)
def test_the_data_order_warning_fires_for_the_trap_and_not_for_the_ways_that_work(spec: str) -> None:
    """Re-seeded per epoch (a new generator, or the one in extras seeded again), or a generator in
    extras drawn from at every step (dropout's): all resume exactly, none is warned. The trap is."""
    report = check_resume(f"{SPECS}:{spec}", draw=4)
    assert report.trap_warned is (spec == "ShuffledLoaderSpec"), report.warnings
    assert report.passed is (spec != "ShuffledLoaderSpec"), report.text()


def test_a_stateful_loader_in_extras_resumes_bitwise_unwarned() -> None:
    report = check_resume("tests.pipeline.specs:LoaderDigitsSpec", {"hidden": 32}, draw=5)
    assert report.passed and not report.trap_warned, report.text()


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_readme_step_specs_and_the_demo_resume_bitwise(tmp_path, monkeypatch, nproc: int) -> None:
    """Every step-level spec the README and the demos show passes ckptflow check."""
    readme_module(
        HABITS_MARKER,
        "readme_habits",
        tmp_path,
        monkeypatch,
    )
    readme_module(
        "<!-- tests/pipeline/test_step_checkpoints.py runs the next code block as written -->",
        "readme_steps",
        tmp_path,
        monkeypatch,
    )
    for spec, config in [
        ("readme_habits:StepSpec", {}),
        ("readme_steps:MySpec", {"batch_size": 256}),
        ("ckptflow.flows.demo:DigitsSpec", {"hidden": 32}),
        ("ckptflow.flows.demo_lm:TinyLMSpec", {}),  # FSDP2-sharded state at 2 processes
    ]:
        report = check_resume(spec, config, nproc=nproc, draw=6)
        assert report.passed, report.text()
        assert len(report.stops) == 2 and report.seconds < MINUTE, report.text()


def test_a_spec_that_trains_whole_epochs_is_stopped_at_an_epoch_end(tmp_path, monkeypatch) -> None:
    readme_module(
        "<!-- tests/pipeline/test_readme_spec.py runs the next code block as written -->",
        "readme_epochs",
        tmp_path,
        monkeypatch,
    )
    report = check_resume("readme_epochs:MySpec", {"batch_size": 256}, epochs=3, draw=7)
    assert report.passed, report.text()
    assert [(p.epoch, p.in_epoch) for p in report.stops] == [(1, 0)], report.stops


def test_the_last_step_of_an_epoch_comes_before_the_epoch_s_end_of_the_same_step() -> None:
    """Both are saved at step 40; the check reports and compares up to the later (the epoch's end)."""
    inside, end = Position(epoch=1, in_epoch=20, step=40), Position(epoch=2, in_epoch=0, step=40)
    assert max([end, inside], key=lambda p: p.order) == end
    assert max([inside, end], key=lambda p: p.order) == end
    assert sorted([end, inside, Position(1, 0, 20)], key=lambda p: p.order)[1:] == [inside, end]
