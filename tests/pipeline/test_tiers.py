"""Resume anywhere: a run's fast tier (``--storage``) and its durable tier (``--upload-to``).

A run SIGKILLed mid-training whose fast tier is then deleted (its machine lost, its pod
rescheduled onto an empty disk) is run again with the same config: it fetches the durable tier's
newest version into the fast tier, resumes there, and ends bit for bit where a run that never
stopped ends. Against a real Prefect server, training processes killed with SIGKILL, and a
SeaweedFS S3 server or a local directory as the durable tier.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from ckptflow.storage import CheckpointStore
from tests.conftest import assert_same_state
from tests.pipeline.helpers import Child, make_config, run_summary
from tests.pipeline.specs import SLOW_FROM_ENV, STEP_SECONDS_ENV
from tests.pipeline.test_crashed_runs import artifacts_of
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


def in_epoch_positions(durable: CheckpointStore) -> list[tuple[int | None, int | None, int | None]]:
    return [p for p in positions(durable) if p[1] is not None]


def test_the_durable_tier_keeps_its_own_cadence_and_the_fast_tier_every_save(prefect_server, tmp_path):
    """``upload_every: epoch``: every step save commits to the fast tier, the durable tier gets
    the versions at epoch ends only; the run says which versions the cadence let go."""
    durable = tmp_path / "durable"
    config = stepped(
        tmp_path / "fast", train_process=False, archive={"upload_to": str(durable), "upload_every": "epoch"}
    )
    summary, run_id = run_summary(config)
    fast = CheckpointStore(config.storage)
    assert positions(fast) == expected_positions()
    ends = [p for p in expected_positions() if p[1] is None]
    assert positions(CheckpointStore(durable)) == ends
    inside = [v.version for v in fast.versions() if v.in_epoch]
    assert summary["mirror_skipped"] == inside and summary["not_mirrored"] == [], summary
    assert summary["durable_newest"] == fast.versions()[-1].version
    assert "skipped by upload_every 'epoch'" in summary["mirror_line"], summary
    # the Prefect UI's progress card says where the durable tier stands
    [progress] = artifacts_of(run_id, "-progress")
    assert f"durable v{summary['durable_newest']}" in progress.description, progress.description


def test_retention_on_the_fast_tier_keeps_the_versions_the_durable_tier_lacks(
    prefect_server, tmp_path, monkeypatch
):
    """A durable tier that refuses every upload: ``keep_last: 1`` removes nothing it lacks (the
    run fails, naming the upload); told to (``keep_undurable: false``), the policy applies."""
    from ckptflow.tasks import archiving
    from tests.pipeline.helpers import run_flow
    from tests.pipeline.test_mirror import refused_endpoint

    monkeypatch.setattr(archiving, "upload_version", archiving.upload_version.with_options(retries=0))
    refused = {
        "client_kwargs": {"endpoint_url": refused_endpoint()},
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
    }
    archive = {"upload_to": "s3://durable/run", "upload_options": refused}
    run_summary(stepped(tmp_path / "fast", train_process=False, epochs=1))  # a run without the tier first
    held = [v.version for v in CheckpointStore(tmp_path / "fast").versions()]
    config = stepped(
        tmp_path / "fast", train_process=False, epochs=2, archive=archive, retention={"keep_last": 1}
    )
    state, _ = run_flow(config)
    assert state.is_failed() and "upload of version" in (state.message or ""), state
    kept = [v.version for v in CheckpointStore(config.storage).versions()]
    assert kept[: len(held)] == held and len(kept) > len(held) + 1, kept  # nothing removed

    told = config.model_copy(
        update={"epochs": 3, "retention": config.retention.model_copy(update={"keep_undurable": False})}
    )
    state, _ = run_flow(told)
    assert state.is_failed(), state
    after = [v.version for v in CheckpointStore(config.storage).versions()]
    assert len(after) == 1 and after[0] > kept[-1], after


@pytest.mark.crash
def test_sigterm_makes_the_newest_version_durable_before_the_run_ends(prefect_server, tmp_path):
    """A durable tier on a cadence far away (``1h``): SIGTERM (a spot notice, a pod evicted) saves
    where the run stands and sends that version up within ``stop_drain_seconds``; a new machine
    resumes from it."""
    durable = tmp_path / "durable"
    archive = {"upload_to": str(durable), "upload_every": "1h"}
    config = stepped(tmp_path / "fast", train_process=True, archive=archive)
    child = Child(
        prefect_server, config, tmp_path / "child.log", **{SLOW_FROM_ENV: "2", STEP_SECONDS_ENV: "0.5"}
    )
    fast = CheckpointStore(config.storage)
    try:
        child.wait_for(lambda: any(v.step == 15 for v in fast.versions()), 180, "the save of step 15")
        os.kill(child.proc.pid, signal.SIGTERM)
        code = child.wait(60)
    finally:
        child.kill()
    result = child.result()
    assert code == 0 and result["state"] == "CANCELLED", child.tail()
    newest = fast.latest()
    assert newest is not None and newest.step > 15
    held = CheckpointStore(durable)
    assert [v.version for v in held.versions()] == [1, newest.version]  # the first, then the stop's
    assert f"durable tier {durable}: holds version {newest.version}" in result["message"], result
    shutil.rmtree(config.storage)
    summary, _ = run_summary(config)
    assert summary["fetched"]["version"] == newest.version == summary["resumed_from"]


@pytest.mark.crash
def test_sigterm_beside_a_silent_durable_tier_ends_in_the_grace_naming_the_versions_only_local(
    prefect_server, tmp_path, silent_endpoint, monkeypatch
):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    silent = {
        "client_kwargs": {"endpoint_url": silent_endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"total_max_attempts": 1}},
    }
    run_summary(stepped(tmp_path / "fast", train_process=False, epochs=1))  # the fast tier holds a run
    archive = {"upload_to": "s3://durable/run", "upload_options": silent, "stop_drain_seconds": 4}
    config = stepped(tmp_path / "fast", train_process=False, epochs=6, archive=archive)
    env = {
        SLOW_FROM_ENV: "13",
        STEP_SECONDS_ENV: "0.3",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
    }
    child = Child(prefect_server, config, tmp_path / "child.log", **env)
    fast = CheckpointStore(config.storage)
    try:
        child.wait_for(lambda: any(v.step == 20 for v in fast.versions()), 180, "the save of step 20")
        signalled = time.monotonic()
        os.kill(child.proc.pid, signal.SIGTERM)
        code = child.wait(60)
        took = time.monotonic() - signalled
    finally:
        child.kill()
    result = child.result()
    assert code == 0 and result["state"] == "CANCELLED", child.tail()
    assert took < config.stop_grace_seconds + 2 * 4 + 10, took  # the save, then two bounded waits
    newest = fast.latest()
    assert newest is not None and newest.step > 20
    assert "durable tier s3://durable/run: could not be read" in result["message"], result
    assert f"versions 1-{newest.version} may be only on the fast tier" in result["message"], result


def test_a_durable_tier_that_answers_again_is_caught_up_within_the_run(prefect_server, tmp_path, monkeypatch):
    """The durable tier fails every upload for a while (its path blocked), then answers again:
    training never waits, the uploads pause ``upload_retry_seconds`` after each failure, and once
    it answers the newest version goes up; the run ends Completed, saying what failed meanwhile."""
    from ckptflow.tasks import archiving
    from ckptflow.tasks.reporting.monitoring import add_listener
    from tests.pipeline.helpers import run_flow

    monkeypatch.setattr(archiving, "upload_version", archiving.upload_version.with_options(retries=0))
    monkeypatch.setenv(SLOW_FROM_ENV, "2")
    monkeypatch.setenv(STEP_SECONDS_ENV, "0.1")
    blocker = tmp_path / "blocked"
    durable = blocker / "durable"
    run_summary(stepped(tmp_path / "fast", train_process=False, epochs=1))
    blocker.write_text("a file where the durable tier's parent directory should be")
    archive = {"upload_to": str(durable), "upload_retry_seconds": 0.5}
    config = stepped(tmp_path / "fast", train_process=False, epochs=3, archive=archive)

    def unblock(kind: str, data: dict) -> None:
        if kind == "committed" and (data["info"].step or 0) >= 24 and blocker.is_file():
            blocker.unlink()

    remove = add_listener(unblock)
    try:
        state, _ = run_flow(config)
    finally:
        remove()
    assert state.is_completed(), state
    summary = state.result()
    outages = summary["durable_outages"]
    assert outages and all(o.startswith("upload of version") for o in outages), summary
    fast = CheckpointStore(config.storage)
    held = CheckpointStore(durable)
    newest = fast.latest()
    assert newest is not None and summary["durable_newest"] == newest.version
    assert held.latest() is not None and held.latest().version == newest.version
    assert_same_state(held.load(), fast.load())


def test_the_durable_tier_keeps_its_own_retention(prefect_server, tmp_path):
    """``durable_keep_last: 2`` prunes the durable tier at the run's end; the fast tier keeps its
    own (every version here); the next run uploads only what is newer than the durable tier's newest."""
    durable = tmp_path / "durable"
    archive = {"upload_to": str(durable), "durable_keep_last": 2}
    summary, _ = run_summary(make_config(tmp_path / "fast", epochs=4, train_process=False, archive=archive))
    assert [v.version for v in CheckpointStore(durable).versions()] == [3, 4]
    assert summary["durable_pruned"] == [1, 2], summary
    assert [v.version for v in CheckpointStore(tmp_path / "fast").versions()] == [1, 2, 3, 4]
    summary, _ = run_summary(make_config(tmp_path / "fast", epochs=5, train_process=False, archive=archive))
    assert [v.version for v in CheckpointStore(durable).versions()] == [4, 5]  # 1 and 2 not sent again
    assert summary["durable_pruned"] == [3], summary
    assert_same_state(CheckpointStore(durable).load(), CheckpointStore(tmp_path / "fast").load())
