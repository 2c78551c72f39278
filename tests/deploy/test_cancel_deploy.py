"""Cancelling a deployed run while a save is in flight: the save commits, the next run resumes from it.

`prefect flow-run cancel ID` (what the UI's Cancel does) makes the worker
send SIGTERM to the flow run's process; Prefect raises TerminationSignal in
its main thread. The run is cancelled at the worst moment: the spec holds the
commit of version 2 (every shard on disk, the manifest not yet written) and
the test cancels as it starts (the commit waits for the SIGTERM, however long
the worker takes to send it: on a loaded machine it took over 6 s, the hold
this test once had). With an async save the main thread is already
training epoch 3 and the flow waits for the save in flight before it ends;
with a synchronous save the main thread is waiting in the save task, which
lets the helper thread finish. Either way version 2 commits after the
cancellation, nothing half-written is left, the run ends Cancelled with
version 2 in its checkpoint table, and the next run of the deployment
resumes from it.

Fixes: a run stopped by the worker's SIGTERM committed the save in flight but
never reported it (its checkpoint table, the store's latest checkpoint and the
committed event all stopped one version short); ``RunMonitor.catch_up`` now
reports it on the way out.
"""

from __future__ import annotations

import logging
import time

import pytest

from ckptflow.storage import CheckpointStore
from ckptflow.tasks.reporting.monitoring import COMMITTED_EVENT, slug
from tests.deploy.helpers import (
    TRAIN,
    Worker,
    checked,
    events,
    poll_until,
    run_artifact,
    run_to_completion,
    start_run,
    table_rows,
    wait_for_file,
    wait_for_state,
)
from tests.deploy.specs import spec_params
from tests.pipeline.helpers import assert_only_committed, run_log_records, task_runs, wait_until
from tests.pipeline.specs import SLOW_FROM_ENV, STEP_SECONDS_ENV, STEPPED_SPEC

pytestmark = pytest.mark.deploy

EPOCHS = 4
IN_FLIGHT = 2


@pytest.mark.parametrize("async_save", [True, False], ids=["async-save", "sync-save"])
def test_cancel_during_a_save_commits_it_and_the_next_run_resumes(stack, tmp_path, async_save):
    markers = tmp_path / "markers"
    spec = spec_params(markers, slow_commit=[IN_FLIGHT, 90], slow_from=IN_FLIGHT + 1, slow_seconds=120)
    config = {
        "storage": str(tmp_path / "store"),
        "epochs": EPOCHS,
        "shards": 2,
        "async_save": async_save,
        **spec,
    }
    run_id = start_run(stack, TRAIN, config)
    with Worker(stack, tmp_path / "worker.log") as worker:
        wait_for_file(markers / f"commit-{IN_FLIGHT}-started", 120, worker)
        cancelled_at = time.time()
        out = checked(stack, "prefect", "flow-run", "cancel", str(run_id))
        assert "successfully scheduled for cancellation" in " ".join(out.split())
        assert worker.wait(120) == 0, worker.output()[-4000:]
    run = wait_for_state(run_id, "CANCELLED", "COMPLETED", "FAILED", "CRASHED", timeout=60)
    assert run.state.type.value == "CANCELLED", f"{run.state}\n{worker.output()[-4000:]}"

    # SIGTERM reached the process while the save was in flight, and the save still committed.
    started, done, sigterm = (
        markers / n for n in (f"commit-{IN_FLIGHT}-started", f"commit-{IN_FLIGHT}-done", "sigterm")
    )
    assert sigterm.exists() and done.exists(), worker.output()[-4000:]
    assert float(started.read_text()) < float(sigterm.read_text()) < float(done.read_text())
    assert float(sigterm.read_text()) > cancelled_at
    # No epoch began after it (a synchronous save: not even the next one).
    assert not (markers / f"epoch-{IN_FLIGHT + (2 if async_save else 1)}-started").exists()
    assert assert_only_committed(tmp_path / "store") == [1, IN_FLIGHT]

    # ...and the run reported it: its checkpoint table and its events include version 2.
    table = run_artifact(run_id, f"ckptflow-{slug(run.name)}-checkpoints")
    assert [r["version"] for r in table_rows(table)] == [1, IN_FLIGHT]
    committed = poll_until(lambda: events(COMMITTED_EVENT, run_id), lambda evs: len(evs) >= IN_FLIGHT)
    assert sorted(e.payload["version"] for e in committed) == [1, IN_FLIGHT]
    # ...cleanly: no line at ERROR on the run or its tasks (Prefect logged the stopped task as
    # "Crash detected!" and the Cancelled run's end as a CancelledRun traceback), the commit of the
    # save in flight is logged, and the task that SIGTERM stopped is Cancelled, not Crashed.
    assert_ended_cleanly(run_id, f"committed version {IN_FLIGHT} (epoch {IN_FLIGHT}, ")
    # ...and its summary: cancelled by the worker's SIGTERM, with the save in flight committed
    cancelled = run_artifact(run_id, f"ckptflow-{slug(run.name)}-summary").data
    assert "# ckptflow run summary: Cancelled" in cancelled
    assert f"| last committed checkpoint | version {IN_FLIGHT}, epoch {IN_FLIGHT}:" in cancelled

    # The next run of the deployment, same parameters, resumes after version 2.
    (markers / "steer.json").unlink()
    resumed = run_to_completion(stack, config, tmp_path / "worker-2.log")
    again = resumed.id
    summary = run_artifact(again, f"ckptflow-{slug(resumed.name)}-summary").data
    assert f"| epochs | {IN_FLIGHT + 1}..{EPOCHS} (resumed from version {IN_FLIGHT}) |" in summary
    assert (markers / f"epoch-{IN_FLIGHT + 1}-started").read_text() == str(again)
    assert assert_only_committed(tmp_path / "store") == list(range(1, EPOCHS + 1))


def test_cancel_inside_an_epoch_of_trainers_ends_cleanly(stack, tmp_path):
    """The UI's Cancel of a deployed run that trains in trainers (the default) inside a slow epoch:
    the run saves the step it stands at and ends Cancelled with no ERROR line and no Crashed task
    (issue 41: "Crash detected!", "Finished in state Crashed" and a CancelledRun traceback read as
    a failed cancel), and its log says which commit came last."""
    storage = tmp_path / "store"
    config = {"storage": str(storage), "epochs": 3, "spec": STEPPED_SPEC, "save_every_steps": 5}
    run_id = start_run(stack, TRAIN, config)
    store = CheckpointStore(str(storage))
    env = {SLOW_FROM_ENV: "2", STEP_SECONDS_ENV: "0.5"}
    with Worker(stack, tmp_path / "worker.log", **env) as worker:
        wait_until(
            lambda: any(v.epoch == 2 and v.in_epoch for v in store.versions()), 180, "a save in epoch 2"
        )
        checked(stack, "prefect", "flow-run", "cancel", str(run_id))
        assert worker.wait(120) == 0, worker.output()[-4000:]
    run = wait_for_state(run_id, "CANCELLED", "COMPLETED", "FAILED", "CRASHED", timeout=60)
    assert run.state.type.value == "CANCELLED", f"{run.state}\n{worker.output()[-4000:]}"
    last = store.latest()
    assert last is not None and last.epoch == 2 and last.in_epoch, [
        (v.epoch, v.in_epoch) for v in store.versions()
    ]
    assert_ended_cleanly(run_id, f"committed version {last.version} (epoch 2, step {last.in_epoch:,}/")


def assert_ended_cleanly(run_id, commit_line: str) -> None:
    """A run cancelled cleanly reads so in its logs and its task runs (issue 41): no ERROR line,
    its last commit logged (``commit_line`` begins the line), every task run final, none Crashed."""

    def complete(records: list[tuple[int, str]]) -> bool:  # the commit, and the run's last line
        messages = [m for _, m in records]
        ended = any(m.startswith("Finished in state Cancelled") for m in messages)
        return ended and any(m.startswith(commit_line) for m in messages)

    logs = poll_until(lambda: run_log_records(run_id), complete, timeout=60)
    assert complete(logs), [m for _, m in logs][-30:]
    assert [m for level, m in logs if level >= logging.ERROR and not prefect_38_exit(m)] == [], logs
    assert any(m.startswith(commit_line) for _, m in logs), [
        m for _, m in logs if "commit" in m or "stop" in m
    ]
    tasks = poll_until(lambda: task_runs(run_id), lambda ts: all(t.state and t.state.is_final() for t in ts))
    assert [t.name for t in tasks if not t.state or t.state.is_crashed() or not t.state.is_final()] == [], [
        (t.name, t.state) for t in tasks
    ]


def prefect_38_exit(message: str) -> bool:
    """Prefect 3.8's engine ends the process of a run that returns its Cancelled state with exit
    status 1, and its worker logs that as an error on the run (3.9's exits 0); the README says so."""
    import re

    import prefect

    old = tuple(int(p) for p in prefect.__version__.split(".")[:2]) < (3, 9)
    return (
        old
        and re.fullmatch(r"Process for flow run '[^']+' exited with status code: 1;.*", message) is not None
    )
