"""A job of rank processes on 127.0.0.1 for the tests: start W processes of one command (a gloo
job's environment each), wait for them, kill one, reap them all, and show their logs on failure."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT = 60.0


@dataclass
class RankJob:
    procs: list[subprocess.Popen]
    out: Path
    timeout = JOB_TIMEOUT  # seconds a wait gives the job by default (a class attribute)

    @staticmethod
    def launch(cmd: list[str], world: int, out: Path, env: dict[str, str]) -> list[subprocess.Popen]:
        """``world`` processes of ``cmd``, rank r logging to ``out/log-r{r}.txt``."""
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        procs = []
        for rank in range(world):
            rank_env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                **env,
            }
            with open(out / f"log-r{rank}.txt", "wb") as log:
                procs.append(
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=rank_env, cwd=ROOT)
                )
        return procs

    def wait(self, timeout: float | None = None) -> list[int]:
        """Every rank's exit code; fail (and kill them all) if one is still running after ``timeout``."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.reap()
                pytest.fail(f"the job did not finish within {timeout:.0f}s (a hang){self.logs()}")
        return [p.returncode for p in self.procs]

    def wait_for(self, name: str, timeout: float | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
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

    def logs(self) -> str:
        parts = []
        for rank in range(len(self.procs)):
            path = self.out / f"log-r{rank}.txt"
            text = path.read_text(errors="replace")[-3000:] if path.exists() else ""
            parts.append(f"\n--- rank {rank} (exit {self.procs[rank].poll()}):\n{text}")
        return "".join(parts)
