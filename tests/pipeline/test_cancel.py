"""Cancelling a local run from Prefect: the epoch in progress is finished, saved and committed.

A local run gets no SIGTERM when cancelled from the UI or the API: the flow
sees its run in Cancelling between epochs, saves the epoch it just trained,
and ends as Cancelled. The run is a child process (the spec slows epoch 2 and
announces it with a marker holding the flow run id); the test sets the state
through the API, as the UI's Cancel button does.
"""

from __future__ import annotations

from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.states import Cancelling, StateType

from tests.deploy.helpers import run_artifacts
from tests.pipeline.helpers import Child, assert_only_committed, make_config, poll, run_summary
from tests.pipeline.specs import MARKERS_ENV, SLOW_FROM_ENV, SLOW_SECONDS_ENV, marker

pytestmark = pytest.mark.prefect

EPOCHS = 4
CANCELLED_IN = 2


def flow_run_state(run_id: UUID):
    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state


@pytest.mark.parametrize("nproc", [1, 2], ids=["one-process", "two-ranks"])
def test_cancelled_run_commits_the_running_epoch_and_resumes_from_it(prefect_server, tmp_path, nproc):
    """With two ranks the flow passes the cancellation to rank 0, which stops both after the epoch."""
    config = make_config(tmp_path / "s", epochs=EPOCHS, nproc=nproc)
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {MARKERS_ENV: str(markers), SLOW_FROM_ENV: str(CANCELLED_IN), SLOW_SECONDS_ENV: "5"}
    child = Child(prefect_server, config, tmp_path / "child.log", **env)
    try:
        started = marker(markers, CANCELLED_IN)
        child.wait_for(started.exists, 120, f"the start of epoch {CANCELLED_IN}")
        run_id = UUID(poll(started.read_text, bool, timeout=5))  # the marker holds the flow run id
        with get_client(sync_client=True) as client:
            result = client.set_flow_run_state(run_id, Cancelling(message="test cancels"), force=True)
        assert result.status.value == "ACCEPT", result
        assert child.wait(90) == 0, child.tail()
    finally:
        child.kill()

    out = child.result()
    assert out["state"] == "CANCELLED" and out["flow_run_id"] == str(run_id)
    state = poll(lambda: flow_run_state(run_id), lambda s: s is not None and s.is_final())
    assert state.type == StateType.CANCELLED, state
    assert f"committing epoch {CANCELLED_IN}" in (state.message or "")
    assert not marker(markers, CANCELLED_IN + 1).exists()  # no epoch began after the cancellation

    # Only committed versions, up to and including the epoch that was running.
    assert assert_only_committed(config.storage) == list(range(1, CANCELLED_IN + 1))
    # ...and its summary says so, with where it stands (issue 19: cancelled runs had none)
    artifacts = {a.key: a for a in run_artifacts(run_id) if a.key}
    summary = next(a.data for key, a in artifacts.items() if key.endswith("-summary"))
    assert "# ckptflow run summary: Cancelled" in summary
    assert f"| last committed checkpoint | version {CANCELLED_IN}, epoch {CANCELLED_IN}:" in summary
    progress = next(a for key, a in artifacts.items() if key.endswith("-progress"))
    assert f"epoch {CANCELLED_IN}/{EPOCHS}" in progress.description and "Cancelled" in progress.description

    summary, _ = run_summary(config)
    assert summary["resumed_from"] == CANCELLED_IN
    assert (summary["first_epoch"], summary["last_epoch"]) == (CANCELLED_IN + 1, EPOCHS)
    assert assert_only_committed(config.storage) == list(range(1, EPOCHS + 1))
