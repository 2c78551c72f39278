"""A real SLURM cluster of one node on 127.0.0.1: munged, slurmctld and slurmd (Debian's
``slurm-wlm`` and ``munge``, which ``.ci/run`` installs), started in the foreground by the
fixture, each in a directory of its own, and stopped by their pids when the module's tests end.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ports import free_port

SLURM_CONF = """\
ClusterName=ckptflow
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=60
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Slurm:
    root: Path
    conf: Path

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return {**(base if base is not None else os.environ), "SLURM_CONF": str(self.conf)}

    def run(self, *args: str) -> str:
        done = subprocess.run(args, env=self.env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{args}: {done.stderr}"
        return done.stdout

    def sbatch(self, script: Path, env: dict[str, str], cwd: Path) -> int:
        done = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            env=self.env(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_for(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not {states} after {timeout:.0f}s: {fields}")
            time.sleep(0.5)


def _daemon(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    for tool in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel"):
        assert shutil.which(tool), f"{tool} not found: install slurm-wlm and munge (.ci/run does)"
    root = Path(tmp_path_factory.mktemp("slurm"))  # the munge socket's path must stay short
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    subprocess.run(["mungekey", "-c", "-k", str(root / "munge.key")], check=True, timeout=30)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(root=root, ctld_port=free_port(), d_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [
        _daemon(
            [
                "munged",
                "-F",
                "-f",
                f"--key-file={root / 'munge.key'}",
                f"--socket={root / 'munge.sock'}",
                f"--log-file={root / 'munged.log'}",
                f"--pid-file={root / 'munged.pid'}",
                f"--seed-file={root / 'munged.seed'}",
            ],
            root / "munged.out",
        )
    ]
    try:
        deadline = time.monotonic() + 30
        while not (root / "munge.sock").exists():
            assert time.monotonic() < deadline, (root / "munged.out").read_text(errors="replace")
            time.sleep(0.1)
        daemons.append(_daemon(["slurmctld", "-D", "-i", "-f", str(conf)], root / "slurmctld.out"))
        daemons.append(_daemon(["slurmd", "-D", "-f", str(conf), "-N", "localhost"], root / "slurmd.out"))
        cluster = Slurm(root, conf)
        deadline = time.monotonic() + 60
        while True:
            info = subprocess.run(
                ["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=30
            )
            if info.stdout.strip() == "idle":
                break
            assert time.monotonic() < deadline, (
                f"the node did not come up: {info.stdout} {info.stderr}\n"
                + (root / "slurmctld.log").read_text(errors="replace")[-2000:]
            )
            time.sleep(0.5)
        yield cluster
    finally:
        if len(daemons) == 3:  # no job outlives the cluster (slurmstepd is a process of its own)
            subprocess.run(["scancel", "--full", "--user", "root"], env=env, timeout=30, check=False)
            time.sleep(2)
        for process in reversed(daemons):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
