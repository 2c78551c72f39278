"""Commits reach Prefect the moment they land, exactly once (issue 19), read back from a real server.

- Lag: with slow epochs (2.5 s), each version's ``ckptflow.checkpoint.committed``
  event is received by the server, and its row is in the store's checkpoint
  table, within 2 s of the manifest's commit time: async saves in the flow's
  process and on 2 ranks, sync saves in one training process. Before the fix
  an async save's commit was reported at the next save: one epoch later.
- Exactly once: a commit nobody reported (its writer was killed right after
  it) is reported by the next run on the store; a run after that reports
  nothing twice; every event of a commit has the same id.
- Summaries: a run that fails ends with a summary saying so, where the last
  committed epoch is, and how to resume.
"""

from __future__ import annotations

import contextvars
import threading
from datetime import datetime, timezone
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

from ckptflow.storage import CheckpointStore
from ckptflow.tasks.reporting.monitoring import event_id, slug, store_key
from tests.pipeline.helpers import committed_events, make_config, open_store, poll, run_flow, run_summary
from tests.pipeline.specs import MARKERS_ENV, SLOW_FROM_ENV, SLOW_SECONDS_ENV

pytestmark = pytest.mark.prefect

LAG_BOUND = 2.0  # seconds from a manifest's commit to its event and its table row
EPOCH_SECONDS = 2.5


def run_logs(run_id: Any) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        return "\n".join(
            r.message for r in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        )


def latest_artifact(key: str) -> Any | None:
    with get_client(sync_client=True) as client:
        found = client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=[key]))
        )
    return found[0] if found else None


class TableWatch:
    """Reads a table artifact every 0.1 s in a thread; remembers when each version's row first showed."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.first_seen: dict[int, datetime] = {}
        self._stop = threading.Event()
        context = contextvars.copy_context()  # the test's Prefect settings (the server's URL)
        self._thread = threading.Thread(target=context.run, args=(self._watch,), daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import json

        while not self._stop.wait(0.1):
            try:
                table = latest_artifact(self.key)
            except Exception:
                continue
            if table is None:
                continue
            now = datetime.now(timezone.utc)
            rows = json.loads(table.data) if isinstance(table.data, str) else table.data
            for row in rows:
                self.first_seen.setdefault(row["version"], now)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.parametrize("where", ["flow process", "training process, sync saves", "2 ranks"])
def test_each_commit_reaches_the_events_and_the_table_within_2s(prefect_server, tmp_path, monkeypatch, where):
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv(MARKERS_ENV, str(markers))
    monkeypatch.setenv(SLOW_FROM_ENV, "2")  # version 1 commits while epoch 2 runs: only that one is slow
    monkeypatch.setenv(SLOW_SECONDS_ENV, str(EPOCH_SECONDS))
    fields = {
        "flow process": {"async_save": True},
        "training process, sync saves": {"train_process": True, "async_save": False},
        "2 ranks": {"nproc": 2, "async_save": True},
    }
    # two epochs: version 1 commits while epoch 2 runs, when it used to wait for the next save
    config = make_config(tmp_path / "store", epochs=2, **fields[where])
    url = CheckpointStore(config.storage).url
    watch = TableWatch(f"{store_key(url)}-checkpoints")
    try:
        run_summary(config)
    finally:
        watch.stop()
    versions = open_store(config).versions()
    assert [v.version for v in versions] == [1, 2]
    events = poll(lambda: committed_events(url), lambda evs: len(evs) >= 2, timeout=30)
    assert sorted(e.payload["version"] for e in events) == [1, 2]  # each once
    by_version = {e.payload["version"]: e for e in events}
    lags = {}
    for info in versions:
        committed = datetime.fromisoformat(info.created)
        lags[info.version] = (
            (by_version[info.version].received - committed).total_seconds(),
            (watch.first_seen[info.version] - committed).total_seconds(),
        )
    print(f"seconds from commit to (event received, table row) by version, {where}: {lags}")
    assert all(event < LAG_BOUND and row < LAG_BOUND for event, row in lags.values()), lags


def test_a_commit_never_reported_is_reported_by_the_next_run_once(prefect_server, tmp_path):
    """Bug fix: a commit followed by a crash never got an event (a store with v1 and v2 committed
    had events only for v2). Here version 2 is committed by a writer outside any flow run, as a
    run killed right after its commit leaves it."""
    config = make_config(tmp_path / "store", epochs=1)
    run_summary(config)
    store = open_store(config)
    v1 = store.versions()[0]
    poll(lambda: committed_events(store.url), lambda evs: len(evs) >= 1, timeout=30)
    # what a run killed after its commit leaves: version 2 committed, no event for it
    state = store.load(1)
    state["progress"] = {"epoch": 2, "step": v1.step}  # a run's version 2 resumes at epoch 2
    v2 = store.save(state, epoch=2, step=v1.step, metrics=dict(v1.metrics), version=2)
    assert [e.payload["version"] for e in committed_events(store.url)] == [1]

    _, second = run_summary(make_config(tmp_path / "store", epochs=3))
    events = poll(lambda: committed_events(store.url), lambda evs: len(evs) >= 3, timeout=30)
    assert sorted(e.payload["version"] for e in events) == [1, 2, 3]
    reported = {e.payload["version"]: e for e in events}
    assert reported[2].id == event_id(store.url, v2)
    logs = poll(lambda: run_logs(second), lambda text: "reporting version 2" in text)
    assert "reporting version 2 (committed, never reported)" in logs

    _, third = run_summary(make_config(tmp_path / "store", epochs=4))  # a third run: nothing twice
    events = poll(lambda: committed_events(store.url), lambda evs: len(evs) >= 4, timeout=30)
    assert sorted(e.payload["version"] for e in events) == [1, 2, 3, 4]
    logs = poll(lambda: run_logs(third), lambda text: "stopped:" in text)
    assert "stopped:" in logs and "never reported" not in logs  # it sent no earlier version again


def failed_run_summary(config: Any) -> tuple[str, Any]:
    """Run ``config``, expect it to fail; return its flow run's name and its summary artifact."""
    state, run_id = run_flow(config)
    assert state.is_failed(), state
    with get_client(sync_client=True) as client:
        name = client.read_flow_run(run_id).name
    summary = latest_artifact(f"ckptflow-{slug(name)}-summary")
    assert summary is not None
    return name, summary


def test_a_failed_run_ends_with_a_summary_of_where_it_stands(prefect_server, tmp_path, monkeypatch):
    from tests.pipeline.specs import FLAKY_SPEC, FlakyDigitsSpec

    monkeypatch.setattr(FlakyDigitsSpec, "failures", {3: 1})
    config = make_config(tmp_path / "store", epochs=4, spec=FLAKY_SPEC, epoch_retries=0)
    name, summary = failed_run_summary(config)
    latest = open_store(config).versions()[-1]
    assert latest.epoch == 2
    assert "# ckptflow run summary: Failed" in summary.data
    assert f"| last committed checkpoint | version 2, epoch 2: `{latest.url}`" in summary.data
    assert "continues from the store's newest committed checkpoint (this run's last: epoch 2)" in summary.data
    assert f"ckptflow restore {latest.url.rsplit('/', 1)[0]} --version 2 --out model.pt" in summary.data
    assert "| wall time | " in summary.data and "| world size | 1 rank |" in summary.data
    progress = latest_artifact(f"ckptflow-{slug(name)}-progress")
    assert progress is not None and "Failed" in progress.description


def test_a_run_whose_init_fails_still_ends_with_a_summary(prefect_server, tmp_path):
    """Failures before the first epoch (here a spec that does not import) get a summary too."""
    config = make_config(tmp_path / "store", epochs=2)
    run_summary(config)  # a committed version 2 for the summary to name
    broken = make_config(tmp_path / "store", epochs=3, spec="tests.pipeline.no_such_module:Spec")
    _, summary = failed_run_summary(broken)
    assert "# ckptflow run summary: Failed" in summary.data
    assert "| epochs | none (init did not finish) |" in summary.data
    assert "| last committed checkpoint | version 2, epoch 2:" in summary.data


def test_a_summary_names_an_exit_crashed_and_says_what_a_resume_continues_after():
    """Bug: a run whose worker was killed ended with SystemExit; its summary said "Failed:
    SystemExit: 1" (Prefect shows it Crashed) and "epochs 1..11" when epoch 10 was the last commit."""
    from types import SimpleNamespace

    from ckptflow.flows.train import _how_it_ended, _trained
    from ckptflow.storage import VersionInfo

    monitor = SimpleNamespace(versions={})
    state, why = _how_it_ended(SystemExit(1), None, monitor)  # type: ignore[arg-type]
    assert state == "Crashed" and why.startswith("the process exited (SystemExit: 1)"), why
    assert _how_it_ended(ValueError("x"), None, monitor)[0] == "Failed"  # type: ignore[arg-type]

    run = SimpleNamespace(first_epoch=1, epoch=11)

    def version(n: int) -> VersionInfo:
        return VersionInfo(
            version=n, epoch=n, step=None, metrics={}, created="", nbytes=1, size=1, url=f"/s/{n}"
        )

    tenth = version(10)
    said = _trained(run, tenth)  # type: ignore[arg-type]
    assert said == "1..11 (last committed: epoch 10; a resume continues after it)", said
    assert _trained(run, version(11)) == "1..11"  # type: ignore[arg-type]
