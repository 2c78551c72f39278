"""Training flow runs whose process was SIGKILLed are marked Crashed by the next run on the host (issue 14).

- The process record: a live process is not gone; an ended one (reaped or a
  zombie) is; a pid now held by a process started at another time is; records
  of another host or pid space, or without all labels, are never judged gone.
- Against the real Prefect server: a ``ckptflow run`` killed with SIGKILL
  mid-epoch stays Running; the next ``ckptflow run`` on the same store marks
  it Crashed with a message naming its process and completes; flow runs of
  another host or without the record stay Running.
- A run Prefect marked Crashed first (the worker saw its child SIGKILLed, the
  out-of-memory case) is finished by the next run on the host: its summary
  with the last committed epoch, its task runs ended, its progress without an
  ETA; once, and never a run of another host (issue 41).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, replace
from datetime import timezone
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from ckptflow.storage import CheckpointStore
from ckptflow.tasks.reporting.crashed import ProcessRecord, is_gone, this_process
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


@dataclass
class StalledRun:
    """``ckptflow run`` of the marked spec into ``tmp_path/store``, in a session of its own, whose
    epoch ``stall`` sleeps 120 s (a run to kill there); the spec's markers go to ``tmp_path/markers``
    and its output to ``tmp_path/run.log``."""

    proc: subprocess.Popen[bytes]
    args: list[str]
    env: dict[str, str]
    cwd: Path = REPO

    def again(self) -> subprocess.CompletedProcess[str]:
        """The same run again, at full speed, to its end."""
        env = {**self.env, SLOW_FROM_ENV: "99"}
        return subprocess.run(self.args, env=env, cwd=self.cwd, capture_output=True, text=True, timeout=300)


def start_stalled_run(
    prefect_server: Any, tmp_path: Path, *, epochs: int, stall: int, relative: bool = False
) -> StalledRun:
    """``relative``: the store given as the README writes it, ``./store``, from ``tmp_path``."""
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {**prefect_server.env(), "PYTHONPATH": str(REPO), MARKERS_ENV: str(markers)}
    spec = ["--spec", MARKED_SPEC, "--spec-config", json.dumps(SPEC_CONFIG), "--shards", "2"]
    storage, cwd = ("./store", tmp_path) if relative else (str(tmp_path / "store"), REPO)
    args = [CKPTFLOW, "run", "--storage", storage, "--epochs", str(epochs), *spec]
    with open(tmp_path / "run.log", "wb") as log:
        proc = subprocess.Popen(
            args,
            env={**env, SLOW_FROM_ENV: str(stall), SLOW_SECONDS_ENV: "120"},
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return StalledRun(proc, args, env, cwd)


def read_run(run_id: UUID | str) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(str(run_id)))


def decoy_run(labels: dict[str, str], storage: Path, **config: Any) -> UUID:
    """A Running ``ckptflow-train`` flow run that no process of ours runs, with ``labels``."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from ckptflow.flows.train import train_pipeline

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(
            train_pipeline, parameters={"config": {"storage": str(storage), **config}}, state=Running()
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
@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_a_killed_run_is_marked_crashed_by_the_next_ckptflow_run(prefect_server, tmp_path, relative):
    """Bug fix: a local run killed with SIGKILL stayed Running in Prefect for good.

    Any run that starts on the same host marks it; in the suite another test's run may start
    first, so the log line is asserted of the run that did the marking (named in the state).
    Issue 53: with the store given as the README writes it (``--storage ./store``), the next run
    marked it Crashed but wrote no summary and left its task Running; each run now records its
    store's one name (its real path) and its commits as they come.
    """
    markers, store = tmp_path / "markers", tmp_path / "store"
    stalled = start_stalled_run(prefect_server, tmp_path, epochs=3, stall=2, relative=relative)
    proc = stalled.proc
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
    assert read_run(killed).labels.get("ckptflow.store") == os.path.realpath(store)

    dead_here = replace(here(), pid=proc.pid, start="1")  # as the killed run's record, on this host
    decoys = [
        decoy_run({**dead_here.labels(), "ckptflow.host": "elsewhere"}, tmp_path / "other-host"),
        decoy_run({}, tmp_path / "no-record"),
    ]
    try:
        resumed = stalled.again()
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
    from ckptflow.tasks.reporting.crashed import record_and_sweep

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


WORKER_CRASH = "Flow run infrastructure exited with non-zero status code -9."  # as a process worker says


def set_crashed(run_id: UUID | str, message: str = WORKER_CRASH) -> None:
    """Set the flow run Crashed, as the worker does when it sees its flow run process die."""
    from ckptflow.tasks.reporting.prefect_runs import mark_crashed, prefect_client

    with prefect_client() as client:
        mark_crashed(client, UUID(str(run_id)), message)


def artifacts_of(run_id: UUID | str, suffix: str) -> list[Any]:
    """The flow run's artifacts whose key ends with ``suffix``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(str(run_id))]))
        )
    return [a for a in found if (a.key or "").endswith(suffix)]


def open_task_runs(run_id: UUID | str) -> list[str]:
    return [t.name for t in task_runs(UUID(str(run_id))) if not t.state.is_final()]


def running_epoch(run_id: UUID) -> None:
    """A ``train_epoch`` task run of the flow run, Running (the epoch a kill cut short)."""
    from prefect import task
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    @task(name="train_epoch")
    def train_epoch() -> None: ...

    with get_client(sync_client=True) as client:
        client.create_task_run(train_epoch, run_id, dynamic_key="0", name="train_epoch-3", state=Running())


def put_artifact(run_id: UUID, key: str, kind: str, data: Any, description: str) -> None:
    from ckptflow.tasks.reporting.prefect_runs import create_artifact

    create_artifact(
        key=key, kind=kind, data=data, description=description, flow_run_id=run_id, task_run_id=None
    )


ETA_PROGRESS = "epoch 2/4, 2.1 s per epoch, ETA 2099-01-01 00:00:04 UTC (in 4 s) (store)"


@pytest.mark.prefect
def test_the_next_run_finishes_the_runs_of_this_host_prefect_marked_crashed_first(prefect_server, tmp_path):
    """Bug fix (issue 41): a run whose process was SIGKILLed under a live worker is marked Crashed by the
    worker before the next run starts; the sweep looked only at active runs, so it got no summary, its
    train_epoch stayed Running and its progress showed an ETA for good. Now the next run on the host
    finishes it (once), and leaves the Crashed runs of other hosts and those with a summary alone."""
    import torch

    from ckptflow.tasks.reporting.artifacts import run_key
    from ckptflow.tasks.reporting.crashed import record_and_sweep

    store = CheckpointStore(str(tmp_path / "store"))
    for epoch in (1, 2):
        last = store.save(
            {"w": torch.full((4,), float(epoch))}, epoch=epoch, metrics={"loss": 0.5}, version=epoch
        )
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    gone = replace(here(), pid=ended.pid, start="1")
    killed = decoy_run(gone.labels(), tmp_path / "store", epochs=4)
    elsewhere = decoy_run({**gone.labels(), "ckptflow.host": "elsewhere"}, tmp_path / "store", epochs=4)
    summarized = decoy_run(gone.labels(), tmp_path / "store", epochs=4)
    for run_id in (killed, elsewhere, summarized):
        running_epoch(run_id)
        key = f"{run_key(read_run(run_id).name)}-progress"
        put_artifact(run_id, key, "progress", 50.0, ETA_PROGRESS)
        set_crashed(run_id)
    put_artifact(
        summarized, f"{run_key(read_run(summarized).name)}-summary", "markdown", "its own", "summary"
    )
    assert summary_of(str(killed)) is None and open_task_runs(killed) == ["train_epoch-3"]  # the bug's state

    current = decoy_run({}, tmp_path / "current")
    log = _Lines()
    try:
        swept = record_and_sweep(current, log)
    finally:
        finish([current])

    name = read_run(killed).name
    assert name in swept and read_run(elsewhere).name not in swept and read_run(summarized).name not in swept
    assert any(
        f"an earlier flow run '{name}'" in line and "was Crashed without its summary" in line
        for line in log.lines
    )
    assert read_run(killed).state.message == WORKER_CRASH  # still the worker's Crashed
    [summary] = artifacts_of(killed, "-summary")
    assert "# ckptflow run summary: Crashed" in summary.data and WORKER_CRASH in summary.data
    assert f"| last committed checkpoint | version 2, epoch 2: `{last.url}`" in summary.data
    assert open_task_runs(killed) == []
    [progress] = artifacts_of(killed, "-progress")  # updated in place: one card
    assert progress.data == 50.0
    assert progress.description == "epoch 2/4; Crashed"

    assert artifacts_of(elsewhere, "-summary") == [] and open_task_runs(elsewhere) == ["train_epoch-3"]
    assert [a.description for a in artifacts_of(elsewhere, "-progress")] == [ETA_PROGRESS]
    assert [a.data for a in artifacts_of(summarized, "-summary")] == ["its own"]  # never a second
    assert open_task_runs(summarized) == ["train_epoch-3"]


@pytest.mark.prefect
@pytest.mark.crash
def test_a_killed_run_crashed_by_prefect_first_is_finished_by_the_next_run(prefect_server, tmp_path):
    """Bug fix (issue 41), with real runs: a ``ckptflow run`` SIGKILLed in epoch 3, after its progress
    showed an ETA, and set Crashed through the API (as a live worker does) before the next run on the
    store starts. That run writes its summary (the last committed epoch), ends its task runs and leaves
    its progress without an ETA."""
    markers, store = tmp_path / "markers", tmp_path / "store"
    stalled = start_stalled_run(prefect_server, tmp_path, epochs=4, stall=3)
    proc = stalled.proc
    try:
        wait_until(lambda: marker(markers, 3).exists() or proc.poll() is not None, 120, "epoch 3")
        assert proc.poll() is None, (tmp_path / "run.log").read_text(errors="replace")[-3000:]
        killed = marker(markers, 3).read_text()
        wait_until(lambda: "ckptflow.pid" in (read_run(killed).labels or {}), 60, "process record")
        wait_until(lambda: len(CheckpointStore(str(store)).versions()) == 2, 60, "version 2 committed")
        progress = poll(
            lambda: artifacts_of(killed, "-progress"), lambda a: a and "ETA" in a[0].description, timeout=60
        )
        assert progress and "ETA" in progress[0].description, progress  # what it showed for good
        # task run states reach the server as events: the epoch's Running one is there before the kill
        epoch = poll(
            lambda: open_task_runs(killed), lambda names: any("train_epoch" in n for n in names), timeout=60
        )
        assert any("train_epoch" in n for n in epoch), epoch
        os.kill(proc.pid, signal.SIGKILL)  # the flow run's process, as the OOM killer does
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # and what it started
        proc.wait(30)
    set_crashed(killed)  # the worker saw its child die: Crashed before the next run starts
    assert summary_of(killed) is None
    last = CheckpointStore(str(store)).versions()[-1]

    resumed = stalled.again()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_run(killed).state.message == WORKER_CRASH
    summary = poll(lambda: summary_of(killed), lambda s: s is not None)
    assert summary is not None, resumed.stderr[-3000:]  # the sweep's warnings, if it could not
    assert "# ckptflow run summary: Crashed" in summary.data and WORKER_CRASH in summary.data
    assert f"| last committed checkpoint | version {last.version}, epoch 2: `{last.url}`" in summary.data
    assert open_task_runs(killed) == []
    [progress] = artifacts_of(killed, "-progress")
    assert "ETA" not in progress.description, progress.description
    assert progress.description == "epoch 2/4; Crashed"
    assert progress.data == 50.0
    assert assert_only_committed(store) == [1, 2, 3, 4]


@pytest.mark.prefect
def test_a_crashed_run_s_summary_says_what_it_committed_not_what_the_store_holds_later(
    prefect_server, tmp_path
):
    """Issue 53: maintenance wrote "last committed checkpoint: none committed" and "a new run
    starts at epoch 1" for a run that committed versions 1-3, after its own retention pass had
    left versions another run committed later. The summary is built from the run's own record
    of its commits, made as it went (the ``ckptflow.last_commit`` label)."""
    import torch
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    from ckptflow.flows.maintenance import maintain_stores
    from ckptflow.tasks.maintenance import MaintenanceConfig
    from ckptflow.tasks.reporting.prefect_runs import record_commit

    store = CheckpointStore(str(tmp_path / "store"))
    run_id = decoy_run({}, tmp_path / "store", epochs=6)
    for epoch in (1, 2, 3):  # the crashed run's commits, each recorded as the run's monitor does
        info = store.save({"w": torch.full((4,), float(epoch))}, epoch=epoch, version=epoch)
        with get_client(sync_client=True) as client:
            record_commit(client, run_id, info)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, Crashed(message="no heartbeat for 90 s"), force=True)
    for epoch in (4, 5, 6):  # a later run's
        store.save({"w": torch.full((4,), float(epoch))}, epoch=epoch, version=epoch)

    report = maintain_stores(
        MaintenanceConfig(storages=[str(tmp_path / "store")], retention={"keep_last": 2})
    )
    assert report[0]["pruned"] == [1, 2, 3, 4] and report[0]["crashed_runs_summarized"] == [
        read_run(run_id).name
    ]
    summary = summary_of(str(run_id))
    assert summary is not None
    assert "| last committed checkpoint | version 3, epoch 3:" in summary.data, summary.data
    assert "none committed" not in summary.data and "version 6" not in summary.data
    progress = artifacts_of(run_id, "-progress")
    assert progress and progress[-1].description.startswith("epoch 3/6"), [a.description for a in progress]
