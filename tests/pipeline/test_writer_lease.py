"""One run per store: a run holds the store's writer lease from before init until it ends.

Bug fixed: two runs on one store at once both reported success, each
committing over the other's versions. Now the second run is refused, before
it builds or writes anything, with a message naming the run that holds the
store; a run killed with SIGKILL leaves its lease behind, and the next run
takes it over (at once on the same host, where the holder's process is
visibly gone; after the lease's timeout from elsewhere); a run that ends
releases it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptflow.storage import CheckpointStore, LeaseInfo, read_lease
from ckptflow.storage.versions.lease import LEASE_FILE
from tests.pipeline.helpers import (
    REPO,
    assert_only_committed,
    make_config,
    poll,
    run_flow,
    run_log_records,
    run_summary,
    start_slowed,
)
from tests.pipeline.specs import MARKED_SPEC, SPEC_CONFIG

pytestmark = pytest.mark.prefect


def test_a_second_run_on_a_store_in_use_is_refused(prefect_server, tmp_path):
    config = make_config(tmp_path / "store", epochs=3)
    store = CheckpointStore(config.storage)
    child, _ = start_slowed(prefect_server, config, tmp_path, 2, 120)  # epoch 1 committed, epoch 2 running
    try:
        held = read_lease(store.loc)
        assert (
            held is not None
            and held.pid == child.proc.pid
            and held.owner.startswith("ckptflow run (flow run")
        )
        run_file = (tmp_path / "store" / "run.json").read_bytes()

        state, _ = run_flow(config)
        assert state.is_failed(), state
        assert "in use by another writer: ckptflow run (flow run" in state.message, state.message
        assert f"pid {child.proc.pid}" in state.message and "wait for it to end" in state.message
        assert [v.version for v in store.versions()] == [1]  # the refused run wrote nothing
        assert (tmp_path / "store" / "run.json").read_bytes() == run_file
        assert read_lease(store.loc) == held
    finally:
        child.kill()

    assert read_lease(store.loc).pid == child.proc.pid  # SIGKILL: nobody released it
    summary, _ = run_summary(config)  # its process is gone: taken over at once
    assert (summary["resumed_from"], summary["last_epoch"]) == (1, 3)
    assert read_lease(store.loc) is None  # released at the end of the run
    assert assert_only_committed(config.storage, garbage_allowed=True) == [1, 2, 3]


def test_a_lease_left_on_another_host_is_taken_over_after_its_timeout(prefect_server, tmp_path):
    config = make_config(tmp_path / "store", epochs=2)
    lease = tmp_path / "store" / LEASE_FILE
    lease.parent.mkdir()
    now = time.time()
    fresh = LeaseInfo(
        "ckptflow run (flow run elsewhere)", "other-host", 77, now - 60, now - 1, 30.0, "a" * 32
    )
    lease.write_bytes(fresh.to_json())
    state, _ = run_flow(config)
    assert state.is_failed() and "host other-host, pid 77" in state.message, state.message
    assert "taken over 30s after its last renewal" in state.message
    assert not (tmp_path / "store" / "run.json").exists()

    stale = LeaseInfo(
        "ckptflow run (flow run elsewhere)", "other-host", 77, now - 600, now - 100, 30.0, "a" * 32
    )
    lease.write_bytes(stale.to_json())
    summary, run_id = run_summary(config)
    assert summary["last_epoch"] == 2
    assert not lease.exists()
    # issue 53: the takeover was said on the process's console only, not in the run's logs
    said = poll(lambda: run_log_records(run_id), lambda rs: any("taking over the lease" in m for _, m in rs))
    [line] = [m for _, m in said if "taking over the lease" in m]
    assert "its holder ckptflow run (flow run elsewhere) (host other-host, pid 77" in line, line
    assert json.loads((tmp_path / "store" / "run.json").read_text())["seed"] == config.seed


def test_the_cli_builds_nothing_on_a_store_another_run_holds(tmp_path):
    """Bug fixed: ``ckptflow run`` gives its training process the job before Prefect starts, and that
    process built the run and wrote ``run.json`` on a store another run was training in."""
    store = tmp_path / "store"
    store.mkdir()
    now = time.time()
    held = LeaseInfo("ckptflow run (flow run elsewhere)", "other-host", 77, now - 60, now, 120.0, "b" * 32)
    (store / LEASE_FILE).write_bytes(held.to_json())
    ckptflow = str(Path(sys.executable).parent / "ckptflow")
    # the CLI's own temporary API, as a user runs it: its start gives the training process time to build
    cli_env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    cli_env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(tmp_path / "prefect"))
    cli_env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    spec = ["--spec", MARKED_SPEC, "--spec-config", json.dumps(SPEC_CONFIG), "--shards", "2"]
    done = subprocess.run(
        [ckptflow, "run", "--storage", str(store), "--epochs", "1", *spec],
        env=cli_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 75, done.stderr[-3000:]  # refused: the store is held (issue 53)
    assert "in use by another writer: ckptflow run (flow run elsewhere) (host other-host, pid 77" in (
        done.stderr
    )
    assert sorted(p.name for p in store.iterdir()) == [LEASE_FILE]  # no run.json, no version
    assert read_lease(CheckpointStore(str(store)).loc) == held


def test_a_training_process_built_before_the_lease_resumes_from_the_newest_version(prefect_server, tmp_path):
    """Bug fixed: two runs started at the same instant spliced history. The second's training
    process, started before its flow held the store, restored the newest version of that moment
    (v1); the first run then committed v2 and v3 and ended; the second flow took the lease and
    trained on from v1, "resuming from v000001" while v3 was committed. Now a flow that takes the
    lease checks what its training process restored, and builds it again from the newest version."""
    from ckptflow.tasks.training import trainer

    run_summary(make_config(tmp_path / "store", epochs=1, train_process=True))
    late = make_config(tmp_path / "store", epochs=4, train_process=True)
    trainer.prestart(late)  # as `ckptflow run` does, before Prefect and before the lease
    assert trainer._prestarted is not None
    assert trainer._prestarted.built().result(timeout=120)["resumed_from"]["version"] == 1
    run_summary(make_config(tmp_path / "store", epochs=3))  # the other run: v2 and v3, then it ends

    summary, _ = run_summary(late)
    assert (summary["resumed_from"], summary["last_epoch"]) == (3, 4)
    assert assert_only_committed(late.storage, garbage_allowed=True) == [1, 2, 3, 4]
    store = CheckpointStore(late.storage)
    assert store.manifest(4).step == store.manifest(3).step + (store.manifest(3).step // 3)  # continues v3
