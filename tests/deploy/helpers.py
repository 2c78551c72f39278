"""Shared pieces of the deployment tests: the CLI as a user runs it, workers, runs and artifacts.

Everything a user would type goes through the real commands (`prefect ...`,
`ckptflow ...`) as subprocesses with the test server's environment; what the
tests check is read back through the Prefect API.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

from tests.prefect_server import PrefectServer

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
POOL = "ckptflow-process"
TRAIN = "ckptflow-train/train"
MAINTENANCE = "ckptflow-maintenance/maintenance"


@dataclass
class Stack:
    """A Prefect server set up the README's way: `ckptflow setup-server`, then `prefect deploy`."""

    server: PrefectServer
    setup_output: str
    deploy_output: str

    @property
    def ui(self) -> str:
        return self.server.url

    def env(self, **extra: str) -> dict[str, str]:
        return {**self.server.env(), "PYTHONUNBUFFERED": "1", **extra}


def command(
    stack: Stack | None, *args: str, cwd: Path = REPO, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``prefect``/``ckptflow`` (from this virtualenv) as a user would; fail with its output."""
    full_env = env if env is not None else (stack.env() if stack else dict(os.environ))
    done = subprocess.run(
        [str(BIN / args[0]), *args[1:]],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done


def checked(stack: Stack, *args: str, cwd: Path = REPO, timeout: float = 120) -> str:
    done = command(stack, *args, cwd=cwd, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def start_run(stack: Stack, deployment: str, config: dict[str, Any], cwd: Path = REPO) -> UUID:
    """``prefect deployment run DEPLOYMENT --param config=JSON``; the new flow run's id."""
    out = checked(
        stack, "prefect", "deployment", "run", deployment, "--param", f"config={json.dumps(config)}"
    )
    found = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert found, out
    return UUID(found.group(1))


class Worker:
    """``prefect worker start --pool ckptflow-process`` in its own session, started outside the repo."""

    def __init__(self, stack: Stack, log: Path, *, run_once: bool = True, **env: str) -> None:
        self.log = log
        args = [str(BIN / "prefect"), "worker", "start", "--pool", POOL] + (
            ["--run-once"] if run_once else []
        )
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                args,
                cwd=log.parent,
                env=stack.env(**env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"worker still running after {timeout:.0f}s:\n{self.output()[-4000:]}"
            ) from None

    def kill(self) -> None:
        """SIGKILL the worker and every process it started (a lost machine)."""
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            _signal(pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """Stop the worker if it still runs, and whatever flow run processes it left."""
        if self.proc.poll() is None:
            children = descendants(self.proc.pid)
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
            for pid in [*children, self.proc.pid]:
                _signal(pid, signal.SIGKILL)
            self.proc.wait(30)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from /proc), children first."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def flow_run(run_id: UUID) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def wait_for_state(run_id: UUID, *types: str, timeout: float) -> Any:
    """Poll the flow run until its state type is one of ``types``; return the run (the caller asserts)."""
    deadline = time.monotonic() + timeout
    run = flow_run(run_id)
    while (run.state is None or run.state.type.value not in types) and time.monotonic() < deadline:
        time.sleep(0.5)
        run = flow_run(run_id)
    return run


def run_to_completion(stack: Stack, config: dict[str, Any], log: Path) -> Any:
    """A run of the training deployment with ``config``, by a worker of its own (its output in
    ``log``), that must end Completed; the flow run."""
    run_id = start_run(stack, TRAIN, config)
    with Worker(stack, log) as worker:
        assert worker.wait(180) == 0, worker.output()[-4000:]
    run = wait_for_state(run_id, "COMPLETED", "FAILED", "CRASHED", timeout=30)
    assert run.state.type.value == "COMPLETED", f"{run.state}\n{worker.output()[-4000:]}"
    return run


def wait_for_file(path: Path, timeout: float, worker: Worker | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if worker is not None and worker.proc.poll() is not None:
            raise AssertionError(f"the worker exited before {path.name}:\n{worker.output()[-4000:]}")
        if time.monotonic() > deadline:
            tail = worker.output()[-4000:] if worker else ""
            raise AssertionError(f"no {path} within {timeout:.0f}s\n{tail}")
        time.sleep(0.05)


def run_artifacts(run_id: UUID) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))


def run_artifact(run_id: UUID, key: str) -> Any:
    """The one artifact of ``key`` that the run created (each key once: updated in place)."""
    found = [a for a in run_artifacts(run_id) if a.key == key]
    assert len(found) == 1, f"{key}: {[(a.key, a.id) for a in run_artifacts(run_id)]}"
    return found[0]


def latest_artifact(key: str) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=[key]))
        )
    assert len(found) == 1, f"artifact {key!r}: {found}"
    return found[0]


def table_rows(artifact: Any) -> list[dict[str, Any]]:
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def events(name: str, run_id: UUID, *, limit: int = 50) -> list[Any]:
    """Events named ``name`` about the flow run (as primary or related resource)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter, EventResourceFilter

    resource = f"prefect.flow-run.{run_id}"
    with get_client(sync_client=True) as client:
        related = client.read_events(
            EventFilter(event=EventNameFilter(name=[name]), related=EventRelatedFilter(id=[resource])),
            limit=limit,
        ).events
        primary = client.read_events(
            EventFilter(event=EventNameFilter(name=[name]), resource=EventResourceFilter(id=[resource])),
            limit=limit,
        ).events
    return related + primary


def poll_until(read: Callable[[], Any], ok: Callable[[Any], bool], timeout: float = 30) -> Any:
    """Call ``read()`` until ``ok(value)``; return the last value either way (the caller asserts)."""
    deadline = time.monotonic() + timeout
    value = read()
    while not ok(value) and time.monotonic() < deadline:
        time.sleep(0.25)
        value = read()
    return value
