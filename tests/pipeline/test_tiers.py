"""Resume anywhere: a run's fast tier (``--storage``) and its durable tier (``--upload-to``).

A run SIGKILLed mid-training whose fast tier is then deleted (its machine lost, its pod
rescheduled onto an empty disk) is run again with the same config: it fetches the durable tier's
newest version into the fast tier, resumes there, and ends bit for bit where a run that never
stopped ends. Against a real Prefect server, training processes killed with SIGKILL, and a
SeaweedFS S3 server or a local directory as the durable tier.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from ckptflow.storage import CheckpointStore
from tests.pipeline.helpers import Child, run_summary
from tests.pipeline.specs import SLOW_FROM_ENV, STEP_SECONDS_ENV
from tests.pipeline.test_step_checkpoints import assert_same_run, expected_positions, positions, stepped

pytestmark = pytest.mark.prefect


def durable_tier(kind: str, tmp_path: Path, s3_bucket: Any) -> tuple[str, dict[str, Any]]:
    if kind == "local":
        return str(tmp_path / "durable"), {}
    bucket, options = s3_bucket
    return f"s3://{bucket}/run", {"client_kwargs": options["client_kwargs"]}


@pytest.fixture
def s3_bucket_if(request: pytest.FixtureRequest) -> Any:
    """The S3 bucket fixture, only for the tests on S3 (a local durable tier starts no server)."""
    if "s3" in request.node.callspec.id:
        return request.getfixturevalue("s3_bucket")
    return None


@pytest.mark.crash
@pytest.mark.parametrize(
    ("nproc", "kind"), [(1, "s3"), (2, "s3"), (1, "local")], ids=["W1-s3", "W2-s3", "W1-local"]
)
def test_a_killed_run_whose_fast_tier_is_gone_resumes_from_the_durable_tier_bitwise(
    prefect_server, tmp_path, s3_bucket_if, nproc, kind
):
    url, options = durable_tier(kind, tmp_path, s3_bucket_if)
    archive = {"upload_to": url, "upload_options": options}
    straight = stepped(tmp_path / "A", nproc=nproc, train_process=True)
    tiered = stepped(tmp_path / "fast", nproc=nproc, train_process=True, archive=archive)
    run_summary(straight)
    durable = CheckpointStore(url, storage_options={**options, "skip_instance_cache": True})

    def durable_reached(step: int) -> bool:
        time.sleep(0.2)  # a listing of the durable tier each time
        newest = durable.latest()
        return newest is not None and (newest.step or 0) >= step

    env = {SLOW_FROM_ENV: "2", STEP_SECONDS_ENV: "0.5"}
    child = Child(prefect_server, tiered, tmp_path / "child.log", **env)
    try:
        child.wait_for(lambda: durable_reached(15), 180, "a durable version at step 15")
    finally:
        child.kill()
    assert child.proc.returncode == -9
    newest_durable = durable.latest()
    assert newest_durable is not None
    local_newest = CheckpointStore(tiered.storage).latest()
    assert local_newest is not None and local_newest.version >= newest_durable.version
    shutil.rmtree(tiered.storage)  # the machine is gone; a new one starts with an empty disk

    summary, _ = run_summary(tiered)
    fetched = summary["fetched"]
    assert fetched is not None and fetched["version"] == newest_durable.version, summary
    assert summary["resumed_from"] == newest_durable.version
    # the versions only the lost fast tier had are named (its note on the durable tier, written as
    # each upload begins: the versions whose upload had not begun are not known)
    lost = fetched["lost"]
    assert lost == list(range(newest_durable.version + 1, newest_durable.version + 1 + len(lost))), fetched
    assert newest_durable.version + len(lost) <= local_newest.version, (fetched, local_newest.version)
    fast = CheckpointStore(tiered.storage)
    after = [p for p in expected_positions() if p[2] > (newest_durable.step or 0)]
    assert positions(fast) == [positions(durable)[newest_durable.version - 1], *after]
    assert_same_run(fast, CheckpointStore(straight.storage), [s for _, _, s in after])
    # the durable tier holds every version, the ones before the loss and the ones after it
    assert positions(durable) == expected_positions()
    assert summary["not_mirrored"] == [], summary


def test_an_empty_fast_tier_whose_durable_tier_cannot_be_read_fails_at_once_naming_both(
    prefect_server, tmp_path
):
    """Starting over beside a durable tier that may hold the run would fork it: the run fails."""
    from tests.pipeline.helpers import run_flow
    from tests.pipeline.test_mirror import refused_endpoint

    refused = {
        "client_kwargs": {"endpoint_url": refused_endpoint()},
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
    }
    config = stepped(tmp_path / "fast", archive={"upload_to": "s3://durable/run", "upload_options": refused})
    state, _ = run_flow(config)
    assert state.is_failed(), state
    message = state.message or ""
    assert "cannot read the durable tier s3://durable/run" in message, message
    assert f"fast tier {config.storage} is empty" in message, message
    assert CheckpointStore(config.storage).latest() is None


def test_a_durable_tier_holding_another_configuration_is_refused_before_anything_is_fetched(
    prefect_server, tmp_path
):
    from ckptflow.tasks.training.run_state import ConfigMismatchError
    from tests.pipeline.helpers import run_flow

    archive = {"upload_to": str(tmp_path / "durable")}
    run_summary(stepped(tmp_path / "fast", archive=archive, epochs=1, train_process=False))
    shutil.rmtree(tmp_path / "fast")
    other = stepped(tmp_path / "fast", archive=archive, epochs=2, seed=7, train_process=False)
    state, _ = run_flow(other)
    assert state.is_failed() and "different configuration" in (state.message or ""), state
    with pytest.raises(ConfigMismatchError):
        state.result()
    assert CheckpointStore(other.storage).latest() is None  # nothing fetched


def test_resume_only_resumes_from_the_durable_tier_when_the_fast_tier_is_empty(prefect_server, tmp_path):
    archive = {"upload_to": str(tmp_path / "durable")}
    run_summary(stepped(tmp_path / "fast", archive=archive, epochs=1, train_process=False))
    shutil.rmtree(tmp_path / "fast")
    summary, _ = run_summary(
        stepped(tmp_path / "fast", archive=archive, epochs=2, resume_only=True, train_process=False)
    )
    newest = CheckpointStore(tmp_path / "durable").versions()
    assert summary["fetched"]["version"] == summary["resumed_from"] and summary["last_epoch"] == 2
    assert newest[-1].epoch == 2
