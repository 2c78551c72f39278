"""Training flow runs whose process was SIGKILLed are marked Crashed by the next run on the host (issue 14).

- The process record: a live process is not gone; an ended one (reaped or a
  zombie) is; a pid now held by a process started at another time is; records
  of another host or pid space, or without all labels, are never judged gone.
- Against the real Prefect server: a ``ckptflow run`` killed with SIGKILL
  mid-epoch stays Running; the next ``ckptflow run`` on the same store marks
  it Crashed with a message naming its process and completes; flow runs of
  another host or without the record stay Running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import replace
from datetime import timezone
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from ckptflow.storage import CheckpointStore
from ckptflow.tasks.crashed import ProcessRecord, is_gone, this_process
from tests.pipeline.helpers import REPO, assert_only_committed, committed_events, poll, task_runs, wait_until
from tests.pipeline.specs import (
    MARKED_SPEC,
    MARKERS_ENV,
    SLOW_FROM_ENV,
    SLOW_SECONDS_ENV,
    SPEC_CONFIG,
    marker,
)

CKPTFLOW = str(Path(sys.executable).parent / "ckptflow")


def here() -> ProcessRecord:
    record = this_process()
    assert record is not None and record.pid == os.getpid()
    return record


def record_of(pid: int) -> ProcessRecord:
    """The record a flow run in process ``pid`` (of this host) would carry."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return replace(here(), pid=pid, start=stat[stat.rfind(")") + 2 :].split()[19])


class TestProcessRecord:
    def test_a_live_process_is_not_gone_an_ended_one_is(self):
        assert not is_gone(here(), here())
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            record = record_of(proc.pid)
            assert not is_gone(record, here())
            proc.kill()
            wait_until(
                lambda: Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] == "Z", 10, "a zombie"
            )
            assert is_gone(record, here())  # not reaped yet: a zombie runs no more
        finally:
            proc.kill()
            proc.wait()
        assert is_gone(record, here())  # reaped: no such pid

    def test_a_reused_pid_is_told_apart_by_its_start_time(self):
        parent = record_of(os.getppid())
        assert not is_gone(parent, here())
        assert is_gone(replace(parent, start=str(int(parent.start) - 1)), here())
        assert is_gone(replace(here(), start="1"), here())

    def test_other_hosts_and_pid_spaces_are_never_judged(self):
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        record = replace(here(), pid=dead.pid, start="12345")
        assert is_gone(record, here())
        assert not is_gone(replace(record, host="elsewhere"), here())
        assert not is_gone(replace(record, space="another-boot/pid:[1]"), here())

    def test_labels_round_trip_and_partial_labels_are_no_record(self):
        labels = here().labels()
        assert ProcessRecord.from_labels(labels) == here()
        assert ProcessRecord.from_labels({**labels, "other": "x"}) == here()
        for key in labels:
            assert ProcessRecord.from_labels({k: v for k, v in labels.items() if k != key}) is None
        assert ProcessRecord.from_labels({**labels, "ckptflow.pid": "12a"}) is None


def read_run(run_id: UUID | str) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(str(run_id)))


def decoy_run(labels: dict[str, str], storage: Path) -> UUID:
    """A Running ``ckptflow-train`` flow run that no process of ours runs, with ``labels``."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from ckptflow.flows.train import train_pipeline

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(
            train_pipeline, parameters={"config": {"storage": str(storage)}}, state=Running()
        )
        if labels:
            client.update_flow_run_labels(run.id, labels)
    return run.id


def finish(run_ids: list[UUID]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        for run_id in run_ids:
            client.set_flow_run_state(run_id, Cancelled(message="test decoy"), force=True)


@pytest.mark.prefect
@pytest.mark.crash
def test_a_killed_run_is_marked_crashed_by_the_next_ckptflow_run(prefect_server, tmp_path):
    """Bug fix: a local run killed with SIGKILL stayed Running in Prefect for good.

    Any run that starts on the same host marks it; in the suite another test's run may start
    first, so the log line is asserted of the run that did the marking (named in the state).
    """
    markers = tmp_path / "markers"
    markers.mkdir()
    store = tmp_path / "store"
    env = {**prefect_server.env(), "PYTHONPATH": str(REPO), MARKERS_ENV: str(markers)}
    spec = ["--spec", MARKED_SPEC, "--spec-config", json.dumps(SPEC_CONFIG), "--shards", "2"]
    args = [CKPTFLOW, "run", "--storage", str(store), "--epochs", "3", *spec]
    with open(tmp_path / "run.log", "wb") as log:
        proc = subprocess.Popen(
            args,
            env={**env, SLOW_FROM_ENV: "2", SLOW_SECONDS_ENV: "120"},
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(lambda: marker(markers, 2).exists() or proc.poll() is not None, 120, "epoch 2")
        assert proc.poll() is None, (tmp_path / "run.log").read_text(errors="replace")[-3000:]
        killed = marker(markers, 2).read_text()  # the flow run id, written by the training process
        # The run records its process from a thread beside training: under a loaded machine its
        # API call may end after epoch 2 begins, and a run killed before that cannot be marked.
        wait_until(lambda: "ckptflow.pid" in (read_run(killed).labels or {}), 60, "process record")
        os.kill(proc.pid, signal.SIGKILL)  # the CLI's process only: it runs the flow
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert read_run(killed).state.type.value == "RUNNING"  # nobody is left to report it
    committed_before = CheckpointStore(str(store)).versions()  # v1, unless its async save was cut short

    dead_here = replace(here(), pid=proc.pid, start="1")  # as the killed run's record, on this host
    decoys = [
        decoy_run({**dead_here.labels(), "ckptflow.host": "elsewhere"}, tmp_path / "other-host"),
        decoy_run({}, tmp_path / "no-record"),
    ]
    try:
        resumed = subprocess.run(
            args, env={**env, SLOW_FROM_ENV: "99"}, cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        crashed = read_run(killed)
        assert crashed.state.type.value == "CRASHED", crashed.state
        assert f"its process (pid {proc.pid} on {dead_here.host}) is gone" in crashed.state.message
        marker_id = re.search(r"marked Crashed by flow run (\S+) on the same host", crashed.state.message)
        assert marker_id is not None, crashed.state.message
        second = read_run(marker(markers, 3).read_text())  # epoch 3 ran in the second run only
        if marker_id.group(1) == str(second.id):
            assert "marked Crashed" in resumed.stderr and crashed.name in resumed.stderr
        else:  # another test's run on this host started first and swept it: as any run does
            sweeper = read_run(marker_id.group(1))
            assert sweeper.labels.get("ckptflow.host") == dead_here.host, sweeper.labels
        assert ProcessRecord.from_labels(crashed.labels) == replace(
            dead_here, start=crashed.labels["ckptflow.pid_start"]
        )
        assert second.id != crashed.id and second.state.type.value == "COMPLETED", second.state
        assert ProcessRecord.from_labels(second.labels) is not None  # it recorded its process too
        assert [read_run(d).state.type.value for d in decoys] == ["RUNNING", "RUNNING"]
    finally:
        finish(decoys)
    assert assert_only_committed(store) == [1, 2, 3]

    # the summary its process could not write, and no task run left Running (issue 19)
    summary = poll(lambda: summary_of(killed), lambda s: s is not None)
    assert summary is not None and "# ckptflow run summary: Crashed" in summary.data
    assert f"its process (pid {proc.pid} on {dead_here.host}) is gone" in summary.data
    if committed_before:
        last = committed_before[-1]
        assert f"| last committed checkpoint | version {last.version}, epoch {last.epoch}:" in summary.data
    else:
        assert "| last committed checkpoint | none committed |" in summary.data
    assert [t.name for t in task_runs(UUID(killed)) if not t.state.is_final()] == []
    # each commit reported once, also one the killed run made but may not have reported
    url = CheckpointStore(str(store)).url
    events = poll(lambda: committed_events(url), lambda evs: len(evs) >= 3, timeout=30)
    assert sorted(e.payload["version"] for e in events) == [1, 2, 3]


class _Lines:
    """A logger that keeps the lines it is given."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, message: str, *args: Any) -> None:
        self.lines.append(message % args if args else message)


@pytest.mark.prefect
def test_the_sweep_line_names_the_earlier_run_not_this_one(prefect_server, tmp_path):
    """Bug fix (issue 34): the run that marks an earlier one logged "marked Crashed: flow runs whose
    process on HOST is gone (NAME)", shown as "Flow run 'THIS-RUN' - marked Crashed ...": it read as
    if the current run had crashed. The line now names the earlier run, when it started and its process."""
    from ckptflow.tasks.crashed import record_and_sweep

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    gone = replace(here(), pid=ended.pid, start="1")
    earlier = decoy_run(gone.labels(), tmp_path / "earlier")
    current = decoy_run({}, tmp_path / "current")
    log = _Lines()
    try:
        marked = record_and_sweep(current, log)
        old = read_run(earlier)
    finally:
        finish([current])
    assert old.name in marked and read_run(current).name not in marked
    assert old.state.type.value == "CRASHED"
    started = (old.start_time or old.created).astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    line = (
        f"an earlier flow run '{old.name}' (started {started}, process {ended.pid} on {gone.host}) had ended "
        "without a final state: marked Crashed"
    )
    assert line in log.lines, log.lines
    assert not [x for x in log.lines if x.startswith("marked Crashed")], log.lines


def summary_of(run_id: str) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)]))
        )
    return next((a for a in found if (a.key or "").endswith("-summary")), None)


@pytest.mark.prefect
def test_maintenance_writes_the_summary_of_a_crashed_run_that_has_none(prefect_server, tmp_path):
    """A run marked Crashed elsewhere (the heartbeat automation) gets its summary from maintenance, once."""
    import torch
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    from ckptflow.flows.maintenance import maintain_stores
    from ckptflow.tasks.maintenance import MaintenanceConfig

    store = CheckpointStore(str(tmp_path / "store"))
    info = store.save({"w": torch.arange(4.0)}, epoch=1, metrics={"loss": 0.5}, version=1)
    run_id = decoy_run({}, tmp_path / "store")
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, Crashed(message="no heartbeat for 90 s"), force=True)
    assert summary_of(str(run_id)) is None

    config = MaintenanceConfig(storages=[str(tmp_path / "store")])
    report = maintain_stores(config)
    assert report[0]["crashed_runs_summarized"] == [read_run(run_id).name]
    summary = summary_of(str(run_id))
    assert summary is not None and "# ckptflow run summary: Crashed" in summary.data
    assert "no heartbeat for 90 s" in summary.data
    assert f"| last committed checkpoint | version 1, epoch 1: `{info.url}`" in summary.data
    assert maintain_stores(config)[0]["crashed_runs_summarized"] == []  # once
