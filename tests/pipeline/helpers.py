"""Shared pieces of the pipeline tests: configs, runs (in-process and in a child), state comparison."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from ckptflow.storage import CheckpointStore, VersionNotFoundError
from ckptflow.tasks.config import PipelineConfig
from tests.children.run_flow import RESULT_PREFIX
from tests.conftest import assert_same_state
from tests.pipeline.specs import (
    MARKED_SPEC,
    MARKERS_ENV,
    SLOW_FROM_ENV,
    SLOW_SECONDS_ENV,
    SPEC_CONFIG,
    marker,
)
from tests.prefect_server import PrefectServer

REPO = Path(__file__).resolve().parents[2]


def make_config(storage: str | Path, **fields: Any) -> PipelineConfig:
    """A small, fast run of the marked digits spec (shards=2 keeps the files few; one process trains
    in the flow's process unless the test asks for trainers)."""
    fields.setdefault("spec", MARKED_SPEC)
    fields.setdefault("spec_config", dict(SPEC_CONFIG))
    fields.setdefault("shards", 2)
    if fields.get("nproc", 1) == 1 and fields.get("nnodes", 1) == 1:
        fields.setdefault("train_process", False)  # in the flow's process: faster; tests of trainers ask
    return PipelineConfig(storage=str(storage), **fields)


def run_flow(config: PipelineConfig | dict[str, Any]) -> tuple[Any, UUID]:
    """Run the flow in this process; return (final State, flow run id)."""
    from ckptflow.flows.train import train_pipeline

    state = train_pipeline(config, return_state=True)
    return state, state.state_details.flow_run_id


def run_summary(config: PipelineConfig) -> tuple[dict[str, Any], UUID]:
    """Run the flow in this process, expect it to complete; return (summary, flow run id)."""
    state, run_id = run_flow(config)
    assert state.is_completed(), f"flow run ended {state.type.value}: {state.message}"
    return state.result(), run_id


class Child:
    """``python -m tests.children.run_flow CONFIG`` in its own session, output to a file."""

    def __init__(self, server: PrefectServer, config: PipelineConfig, out: Path, **env: str) -> None:
        self.out = out
        child_env = {**server.env(), **env}
        with open(out, "wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.children.run_flow", config.model_dump_json()],
                cwd=REPO,
                env=child_env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll until ``predicate()``; fail (with the child's output) on timeout or an early exit."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"child exited ({self.proc.returncode}) before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the child's whole session (the child and anything it started)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGUSR2)  # its threads' stacks (tests/children/run_flow.py)
            time.sleep(1)
            self.kill()
            raise AssertionError(f"child still running after {timeout:.0f}s:\n{self.tail(12000)}") from None

    def result(self) -> dict[str, Any]:
        lines = [ln for ln in self.output().splitlines() if ln.startswith(RESULT_PREFIX)]
        assert lines, f"the child printed no result:\n{self.tail()}"
        return json.loads(lines[-1][len(RESULT_PREFIX) :])

    def tail(self, n: int = 4000) -> str:
        return self.output()[-n:]


def open_store(config: PipelineConfig) -> CheckpointStore:
    return CheckpointStore(config.storage, storage_options=config.storage_options)


def version_dirs(root: str | Path) -> list[str]:
    """Version directories present on a local store, committed or not."""
    return sorted(p.name for p in Path(root).iterdir() if p.name.startswith("v") and p.name[1:].isdigit())


def assert_only_committed(root: str | Path, *, garbage_allowed: bool = False) -> list[int]:
    """Every listed version verifies and loads; return them.

    Directories of versions that are not listed (a save cut off by a kill) are allowed only with
    ``garbage_allowed``, and must have no manifest: they are garbage, not half-visible versions.
    """
    store = CheckpointStore(str(root))
    listed = [v.version for v in store.versions()]
    for v in listed:
        store.verify(v)
        state = store.load(v)
        assert state["progress"]["epoch"] == v
    unlisted = sorted(set(version_dirs(root)) - {f"v{v:06d}" for v in listed})
    if not garbage_allowed:
        assert not unlisted, f"directories {version_dirs(root)} but committed versions {listed}"
    for name in unlisted:
        assert not (Path(root) / name / "manifest.json").exists(), f"{name} has a manifest but is not listed"
        with pytest.raises(VersionNotFoundError):
            store.load(int(name[1:]))
    return listed


def assert_same_checkpoint(got: CheckpointStore, want: CheckpointStore, version: int) -> None:
    """Version ``version`` of both stores holds the same state, bit for bit, and the same metrics.

    Everything is compared (model, optimizer, scheduler, spec state, progress, the torch and
    NumPy RNG states) except the state of Python's global ``random``: in a Prefect process it is
    shared with the events client's loop thread, whose websocket pings (``random.getrandbits``)
    may land in the middle of an epoch. A spec must not rely on it for a bitwise resume.
    """
    got_state, want_state = got.load(version), want.load(version)
    assert set(want_state) >= {"model", "optimizer", "scheduler", "rng", "progress"}
    assert set(want_state["rng"]) >= {"torch", "numpy", "python"}
    assert set(got_state["rng"]) == set(want_state["rng"])
    got_state["rng"].pop("python")
    want_state["rng"].pop("python")
    assert_same_state(got_state, want_state)
    got_m, want_m = got.manifest(version), want.manifest(version)
    assert (got_m.epoch, got_m.step) == (want_m.epoch, want_m.step)
    assert_same_state(dict(got_m.metrics), dict(want_m.metrics), "metrics")


def assert_same_metrics(got: CheckpointStore, want: CheckpointStore) -> None:
    """The committed versions of both stores have the same epochs and metrics (floats bit for bit)."""
    got_v, want_v = got.versions(), want.versions()
    assert [v.version for v in got_v] == [v.version for v in want_v]
    for g, w in zip(got_v, want_v, strict=True):
        assert (g.epoch, g.step) == (w.epoch, w.step), f"version {w.version}"
        assert_same_state(g.metrics, w.metrics, f"v{w.version}/metrics")


def start_slowed(
    server: PrefectServer, config: PipelineConfig, tmp_path: Path, epoch: int, timeout: float
) -> tuple[Child, Path]:
    """A :class:`Child` of the marked spec, returned once ``epoch`` has begun (it sleeps in it).

    The spec marks the start of each epoch in ``tmp_path / "markers"``, the directory returned.
    """
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {MARKERS_ENV: str(markers), SLOW_FROM_ENV: str(epoch), SLOW_SECONDS_ENV: "120"}
    child = Child(server, config, tmp_path / "child.log", **env)
    try:
        child.wait_for(lambda: marker(markers, epoch).exists(), timeout, f"the start of epoch {epoch}")
    except BaseException:
        child.kill()
        raise
    return child, markers


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.05)


def poll(
    read: Callable[[], Any], ok: Callable[[Any], bool], timeout: float = 20.0, every: float = 0.25
) -> Any:
    """Call ``read()`` until ``ok(value)``; return the last value either way (the caller asserts)."""
    deadline = time.monotonic() + timeout
    value = read()
    while not ok(value) and time.monotonic() < deadline:
        time.sleep(0.25)
        value = read()
    return value


def committed_events(store_url: str) -> list[Any]:
    """The ``ckptflow.checkpoint.committed`` events of a store's versions, read from the API."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    from ckptflow.tasks.reporting.monitoring import COMMITTED_EVENT

    query = EventFilter(
        event=EventNameFilter(name=[COMMITTED_EVENT]),
        resource=EventResourceFilter(id_prefix=[f"ckptflow.checkpoint.{store_url}/v"]),
    )
    with get_client(sync_client=True) as client:
        return client.read_events(query, limit=50).events


def run_logs(flow_run_id: UUID) -> list[str]:
    """The messages a flow run (and its task runs) logged, as the API has them so far."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def run_log_records(flow_run_id: UUID) -> list[tuple[int, str]]:
    """(level, message) of every line a flow run and its task runs logged, as the API has them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    records: list[tuple[int, str]] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=len(records)
            )
            records += [(log.level, log.message) for log in page]
            if len(page) < 200:
                return records


def task_runs(flow_run_id: UUID) -> list[Any]:
    """The task runs of a flow run, read through the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def run_counts(flow_run_id: UUID, task_name: str, expected_runs: int) -> list[int]:
    """``run_count`` of each run of one task, once the API has recorded ``expected_runs`` final ones.

    Task run states reach the server as events, a moment after the flow run ends: poll.
    """

    def read() -> list[Any]:
        return [t for t in task_runs(flow_run_id) if t.name.startswith(f"{task_name}-")]

    runs = poll(read, lambda rs: len(rs) == expected_runs and all(t.state and t.state.is_final() for t in rs))
    assert len(runs) == expected_runs, f"{task_name}: {[(t.name, t.state_type) for t in runs]}"
    return sorted(t.run_count for t in runs)


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (from /proc; none once it has exited)."""
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(p) for p in (task / "children").read_text().split()]
    except OSError:
        pass
    return found


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, its children's, and so on (the trainers: launcher, ranks)."""
    found: list[int] = []
    todo = children(pid)
    while todo:
        found.append(todo.pop())
        todo += children(found[-1])
    return found


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: it runs no more)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def documented_block(marker: str) -> str:
    """The text after ``marker`` in the README or a page of docs/ (the one that holds it): the
    documentation's code blocks are tested where they stand."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    holding = [p for p in pages if marker in p.read_text()]
    assert len(holding) == 1, f"the marker {marker!r} is in {len(holding)} pages, not one: {holding}"
    return holding[0].read_text().split(marker, 1)[1].lstrip()


def readme_module(marker: str, module: str, tmp_path: Path, monkeypatch: Any) -> None:
    """The python block after ``marker`` in the README or docs/, as written, as importable module
    ``module`` (here, and in training processes through PYTHONPATH); pop it from ``sys.modules`` after."""
    block = documented_block(marker)
    assert block.startswith("```python\n"), "the README's marker is not followed by a python block"
    (tmp_path / f"{module}.py").write_text(block[len("```python\n") :].split("\n```", 1)[0] + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    )
