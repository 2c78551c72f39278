"""Runs whose process died do not stay Running: the heartbeat automation marks them Crashed.

Deployed runs emit ``prefect.flow-run.heartbeat`` every 30 s (the deployments'
``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``); `ckptflow setup-server --within 40`
makes the automation crash a run 40 s after its last heartbeat. Two runs of
the training deployment on two workers: ``healthy`` (two epochs of 28 s, so
it outlives the automation's window) and ``doomed``, whose worker and flow
run process are SIGKILLed during epoch 2, as when a machine is lost.

Then: the doomed run is still Running right after the kill (nobody is left to
report it), becomes Crashed by the automation within a bounded wait, and its
committed checkpoint is intact; the healthy run is never crashed and
completes (with Prefect's default of 180 s between heartbeats it would have
been); the next run of the deployment resumes the doomed run's store.

(A worker killed alone takes its runs with it: a flow run process whose
worker is gone dies at its next console log line, on the broken pipe, and
reports itself Crashed. The automation covers the case where nothing is left
to report.)
"""

from __future__ import annotations

import time

import pytest

from ckptflow.tasks.reporting.monitoring import slug
from tests.deploy.helpers import (
    TRAIN,
    Worker,
    checked,
    flow_run,
    run_artifact,
    run_to_completion,
    start_run,
    wait_for_file,
    wait_for_state,
)
from tests.deploy.specs import spec_params
from tests.pipeline.helpers import assert_only_committed

pytestmark = [pytest.mark.deploy, pytest.mark.crash]

WITHIN = 40


@pytest.fixture
def short_window(stack):
    """The automation with a 40 s window for this test (setup-server updates it in place), then back."""
    assert "updated" in checked(stack, "ckptflow", "setup-server", "--within", str(WITHIN))
    yield
    checked(stack, "ckptflow", "setup-server")


def state_types(run_id) -> list[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return [s.type.value for s in client.read_flow_run_states(run_id)]


def test_a_killed_run_is_marked_crashed_and_the_next_run_resumes(stack, short_window, tmp_path):
    doomed_markers, healthy_markers = tmp_path / "doomed", tmp_path / "healthy"
    doomed_config = {
        "storage": str(tmp_path / "doomed-store"),
        "epochs": 3,
        "shards": 2,
        **spec_params(doomed_markers, slow_from=2, slow_seconds=600),
    }
    healthy_config = {
        "storage": str(tmp_path / "healthy-store"),
        "epochs": 2,
        "shards": 2,
        **spec_params(healthy_markers, slow_from=1, slow_seconds=28),
    }
    healthy = start_run(stack, TRAIN, healthy_config)
    with Worker(stack, tmp_path / "worker-healthy.log") as keeper:
        wait_for_file(healthy_markers / "epoch-1-started", 120, keeper)  # picked up: the next worker cannot
        doomed = start_run(stack, TRAIN, doomed_config)
        with Worker(stack, tmp_path / "worker-doomed.log") as worker:
            wait_for_file(doomed_markers / "epoch-2-started", 120, worker)
            wait_for_file(tmp_path / "doomed-store" / "v000001" / "manifest.json", 30, worker)  # committed
            worker.kill()  # the worker and its flow run process: the machine is gone
            killed_at = time.monotonic()
        assert flow_run(doomed).state.type.value == "RUNNING"

        crashed = wait_for_state(doomed, "CRASHED", "COMPLETED", "FAILED", timeout=WITHIN + 60)
        waited = time.monotonic() - killed_at
        assert crashed.state.type.value == "CRASHED", crashed.state
        assert f"No heartbeat for {WITHIN}s" in crashed.state.message
        assert waited < WITHIN + 40

        assert keeper.wait(120) == 0, keeper.output()[-4000:]
    done = wait_for_state(healthy, "COMPLETED", "CRASHED", "FAILED", timeout=30)
    assert done.state.type.value == "COMPLETED", f"{done.state}\n{keeper.output()[-3000:]}"
    assert "CRASHED" not in state_types(healthy)
    assert assert_only_committed(tmp_path / "doomed-store", garbage_allowed=True) == [1]

    (doomed_markers / "steer.json").unlink()
    resumed = run_to_completion(stack, doomed_config, tmp_path / "worker-2.log")
    again = resumed.id
    summary = run_artifact(again, f"ckptflow-{slug(resumed.name)}-summary").data
    assert "| epochs | 2..3 (resumed from version 1) |" in summary
    assert assert_only_committed(tmp_path / "doomed-store") == [1, 2, 3]
