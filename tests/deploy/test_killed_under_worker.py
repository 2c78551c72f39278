"""A flow run process SIGKILLed under a live worker (the out-of-memory case) is finished by the next run.

The worker sees its child die and Prefect marks the run Crashed at once, before
any other run starts: the next run's sweep of runs still Running never sees
it. Bug fix (issue 41): that run was left half-cleaned, with no summary, its
``train_epoch`` task run Running and its progress showing an ETA for good.
Now the next run of the deployment on the host writes its summary (the last
committed epoch), ends its task runs and shows its progress without an ETA.
"""

from __future__ import annotations

import os
import signal

import pytest

from ckptflow.tasks.reporting.monitoring import slug
from tests.deploy.helpers import (
    TRAIN,
    Worker,
    flow_run,
    poll_until,
    run_artifacts,
    run_to_completion,
    start_run,
    wait_for_file,
    wait_for_state,
)
from tests.deploy.specs import spec_params
from tests.pipeline.helpers import assert_only_committed, task_runs

pytestmark = [pytest.mark.deploy, pytest.mark.crash]


def artifact(run_id, key):
    """The run's artifact ``key``, if it has one (each key once: updated in place)."""
    found = [a for a in run_artifacts(run_id) if a.key == key]
    assert len(found) <= 1, [(a.key, a.id) for a in found]
    return found[0] if found else None


def test_a_run_killed_under_a_live_worker_is_finished_by_the_next_run(stack, tmp_path):
    markers, store = tmp_path / "markers", tmp_path / "store"
    config = {
        "storage": str(store),
        "epochs": 4,
        "shards": 2,
        **spec_params(markers, slow_from=3, slow_seconds=600),
    }
    killed = start_run(stack, TRAIN, config)
    with Worker(stack, tmp_path / "worker.log") as worker:
        wait_for_file(markers / "epoch-3-started", 180, worker)
        wait_for_file(store / "v000002" / "manifest.json", 60, worker)  # epoch 2 committed
        run = poll_until(lambda: flow_run(killed), lambda r: "ckptflow.pid" in (r.labels or {}), 60)
        progress_key = f"ckptflow-{slug(run.name)}-progress"
        shown = poll_until(
            lambda: artifact(killed, progress_key), lambda a: a is not None and "ETA" in a.description, 60
        )
        assert shown is not None and "ETA" in shown.description, shown  # what it would show for good
        os.kill(int(run.labels["ckptflow.pid"]), signal.SIGKILL)  # the flow run's process only
        crashed = wait_for_state(killed, "CRASHED", "COMPLETED", "FAILED", timeout=60)
        assert crashed.state.type.value == "CRASHED", f"{crashed.state}\n{worker.output()[-3000:]}"
        assert worker.wait(60) == 0, worker.output()[-4000:]  # it lived on, and reported the crash
    assert artifact(killed, f"ckptflow-{slug(run.name)}-summary") is None  # no process left to write it

    (markers / "steer.json").unlink()
    run_to_completion(stack, config, tmp_path / "worker-2.log")

    summary = artifact(killed, f"ckptflow-{slug(run.name)}-summary")
    assert summary is not None and "# ckptflow run summary: Crashed" in summary.data
    assert "| last committed checkpoint | version 2, epoch 2:" in summary.data
    assert [t.name for t in task_runs(killed) if not t.state.is_final()] == []
    progress = artifact(killed, progress_key)
    assert progress is not None and "ETA" not in progress.description, progress
    assert progress.description == "epoch 2/4; Crashed", progress.description
    assert progress.data == 50.0
    assert flow_run(killed).state.type.value == "CRASHED"
    assert assert_only_committed(store) == [1, 2, 3, 4]
