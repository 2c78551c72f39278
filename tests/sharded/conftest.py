"""FSDP2 jobs for the sharded-state tests: real gloo process groups of 1-4 ranks on 127.0.0.1.

Each job is ``tests/children/fsdp_child.py`` in ``world`` processes; rank 0 writes the digest of
the job's full (gathered) model and optimizer state to ``full.json``. The saved stores are made
once per session (this package runs on one xdist worker, see tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT = 180.0


@dataclass
class FsdpJob:
    procs: list[subprocess.Popen]
    out: Path

    @classmethod
    def start(
        cls, scenario: str, world: int, url: str, out: Path, *args: str, storage_options: Any = None
    ) -> FsdpJob:
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1",
                "CKPTFLOW_STORAGE_OPTIONS": json.dumps(storage_options),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            }
            cmd = [sys.executable, "-m", "tests.children.fsdp_child", scenario, url, str(out), *args]
            with open(out / f"log-r{rank}.txt", "wb") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
        return cls(procs, out)

    @classmethod
    def run(
        cls, scenario: str, world: int, url: str, out: Path, *args: str, storage_options: Any = None
    ) -> FsdpJob:
        job = cls.start(scenario, world, url, out, *args, storage_options=storage_options)
        try:
            codes = job.wait()
        finally:
            job.reap()
        if any(codes):
            pytest.fail(f"{scenario} at W={world} failed: exit codes {codes}{job.logs()}")
        return job

    def wait(self, timeout: float = JOB_TIMEOUT) -> list[int]:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.reap()
                pytest.fail(f"the job did not finish within {timeout:.0f}s{self.logs()}")
        return [p.returncode for p in self.procs]

    def wait_for(self, name: str, timeout: float = JOB_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not (self.out / name).exists():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.reap()
                pytest.fail(f"no {name} within {timeout:.0f}s, or a rank exited early{self.logs()}")
            time.sleep(0.02)

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].wait(timeout=30)

    def reap(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)

    def full(self) -> Any:
        """The digest of the job's full state (rank 0's ``full.json``)."""
        return json.loads((self.out / "full.json").read_text())

    def result(self, rank: int = 0) -> Any:
        return json.loads((self.out / f"result-r{rank}.json").read_text())

    def logs(self) -> str:
        parts = []
        for rank in range(len(self.procs)):
            path = self.out / f"log-r{rank}.txt"
            text = path.read_text(errors="replace")[-3000:] if path.exists() else ""
            parts.append(f"\n--- rank {rank} (exit {self.procs[rank].poll()}):\n{text}")
        return "".join(parts)


@dataclass(frozen=True)
class Saved:
    """A store holding version 1, saved by an FSDP2 job, and the digest of the state it saved."""

    url: str
    full: Any
    version: int


@pytest.fixture(scope="session")
def saved_by_store(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """FSDP2 at W=2, saved with ``CheckpointStore.save``."""
    root = tmp_path_factory.mktemp("fsdp-store")
    job = FsdpJob.run("save", 2, str(root / "store"), root / "job")
    return Saved(str(root / "store"), job.full(), job.result()["version"])


@pytest.fixture(scope="session")
def saved_by_dcp(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """FSDP2 at W=2, saved with ``dcp.save`` through ``store.dcp_writer``."""
    root = tmp_path_factory.mktemp("fsdp-dcp")
    job = FsdpJob.run("dcp_save", 2, str(root / "store"), root / "job")
    return Saved(str(root / "store"), job.full(), job.result()["version"])


def digest(value: Any) -> Any:
    """fsdp_child's digest, through JSON (tuples become lists), to compare with ``full.json``."""
    from tests.children.fsdp_child import digest as raw_digest

    return json.loads(json.dumps(raw_digest(value)))
