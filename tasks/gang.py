"""Launch the ranks of a multi-process run and relay what rank 0 reports.

``train_ranks`` starts ``nproc`` processes of :mod:`.rank_worker` with
torch.distributed's environment (``MASTER_ADDR`` 127.0.0.1 and a free port),
hands each its job on stdin, and listens for rank 0's reports on an
authenticated local socket: epochs, commits, the end. Those become the run's
logs, artifacts and events in this process, the one Prefect knows.

If any rank dies or fails, the others are killed and the task fails with the
tail of the failed rank's output; a retry of the task starts the ranks again
and they resume from the last commit. A cancellation of the flow run is passed
to rank 0, which stops after the epoch in progress, saves and commits it. If
this process is interrupted (a worker's SIGTERM), the ranks get SIGTERM, do
the same, and are waited for before the interruption goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from .childenv import FLOW_RUN_ENV, REPORT_ADDRESS_ENV, REPORT_KEY_ENV
from .config import PipelineConfig

Message = dict[str, Any]
GRACE_SECONDS = 120.0  # how long interrupted ranks get to commit the save in flight


class RankCrashedError(RuntimeError):
    """A training rank exited with an error or was killed; nothing after the last commit is kept."""


@dataclass
class GangResult:
    reason: str | None = None
    last_epoch: int | None = None
    resumed_from: int | None = None
    messages: list[Message] = field(default_factory=list)


class Gang:
    """``nproc`` rank processes of one run, and rank 0's line back to this process."""

    def __init__(self, config: PipelineConfig, storage_options: dict[str, Any]) -> None:
        self.config = config
        key = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        self._logs = tempfile.TemporaryDirectory(prefix="ckptflow-ranks-")
        self._conn: Connection | None = None
        self._accepting = threading.Thread(target=self._accept, name="ckptflow-rank0-accept", daemon=True)
        self._accepting.start()
        job = json.dumps({"config": config.model_dump(mode="json"), "storage_options": storage_options})
        master_port = str(_free_port())
        run_id = _flow_run_id()
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(config.nproc):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(config.nproc),
                "LOCAL_WORLD_SIZE": str(config.nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": master_port,
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(_threads_per_rank(config.nproc))),
            }
            if run_id:
                env[FLOW_RUN_ENV] = run_id
            if rank == 0:
                env[REPORT_ADDRESS_ENV] = f"{host}:{port}"
                env[REPORT_KEY_ENV] = key.hex()
            with open(self.log_path(rank), "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "ckptflow.tasks.rank_worker", "-"],
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            assert proc.stdin is not None
            proc.stdin.write(job.encode())
            proc.stdin.close()
            self.procs.append(proc)

    def log_path(self, rank: int) -> Path:
        return Path(self._logs.name) / f"rank-{rank}.log"

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # OSError: the listener was closed, the ranks are gone
            self._conn = self._listener.accept()

    def run(self, on_message: Callable[[Message], None], cancel_requested: Callable[[], bool]) -> GangResult:
        """Relay rank 0's messages until every rank has exited; raise RankCrashedError if one failed."""
        result = GangResult()
        cancel_sent = False
        while True:
            for message in self._receive(0.2):
                _note(result, message, on_message)
            failed = [(r, p.returncode) for r, p in enumerate(self.procs) if p.poll() not in (None, 0)]
            if failed:
                self.kill()
                rank, code = failed[0]
                raise RankCrashedError(self._failure(rank, code))
            if all(p.poll() == 0 for p in self.procs):
                for message in self._receive(0):  # what rank 0 sent just before it exited
                    _note(result, message, on_message)
                return result
            if not cancel_sent and cancel_requested():  # cheap: the flow's CancelWatch reads the API
                cancel_sent = self.cancel()

    def _receive(self, timeout: float) -> list[Message]:
        conn = self._conn
        if conn is None:
            time.sleep(timeout)
            return []
        out: list[Message] = []
        try:
            while conn.poll(timeout if not out else 0):
                out.append(json.loads(conn.recv_bytes()))
        except (EOFError, OSError):  # rank 0 is gone; its exit code tells why
            self._conn = None
        return out

    def cancel(self) -> bool:
        """Ask rank 0 to stop after the epoch in progress (it saves and commits it)."""
        if self._conn is None:
            return False
        try:
            self._conn.send_bytes(json.dumps({"kind": "cancel"}).encode())
        except OSError:
            return False
        return True

    def interrupt(self, grace: float = GRACE_SECONDS) -> None:
        """SIGTERM every rank (they stop after the epoch and commit the save), then wait, then kill."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def _failure(self, rank: int, code: int) -> str:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        tail = _tail(self.log_path(rank))
        return f"training rank {rank} of {len(self.procs)} {how}; the other ranks were stopped" + (
            f". Its last output:\n{tail}" if tail else ""
        )

    def close(self) -> None:
        self.kill()
        self._listener.close()
        if self._conn is not None:
            self._conn.close()
        self._logs.cleanup()

    def __enter__(self) -> Gang:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _note(result: GangResult, message: Message, on_message: Callable[[Message], None]) -> None:
    result.messages.append(message)
    if message["kind"] == "started":
        result.resumed_from = message.get("resumed_from")
    elif message["kind"] == "done":
        result.reason, result.last_epoch = message.get("reason"), message.get("epoch")
    on_message(message)


@task(name="train_ranks", cache_policy=NO_CACHE)
def train_ranks(
    config: PipelineConfig, on_message: Callable[[Message], None], cancel_requested: Callable[[], bool]
) -> GangResult:
    """Train on ``config.nproc`` ranks from the newest committed checkpoint to the end of the run.

    A retry (after a rank crashed) starts every rank again; they resume from the last commit.
    """
    with Gang(config, config.resolved_storage_options()) as gang:
        try:
            return gang.run(on_message, cancel_requested)
        except RankCrashedError:
            raise
        except BaseException:  # interrupted here: let the ranks commit what they are saving
            gang.interrupt()
            raise


def _flow_run_id() -> str:
    from prefect.runtime import flow_run

    return str(flow_run.get_id() or "")


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _threads_per_rank(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


__all__ = ["Gang", "GangResult", "RankCrashedError", "train_ranks"]
