"""FSDP2 jobs for the sharded-state tests: real gloo process groups of 1-4 ranks on 127.0.0.1.

Each job is ``tests/children/fsdp_child.py`` in ``world`` processes; rank 0 writes the digest of
the job's full (gathered) model and optimizer state to ``full.json``. The saved stores are made
once per session (this package runs on one xdist worker, see tests/conftest.py).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import RankJob

JOB_TIMEOUT = 180.0


class FsdpJob(RankJob):
    timeout = JOB_TIMEOUT

    @classmethod
    def start(
        cls, scenario: str, world: int, url: str, out: Path, *args: str, storage_options: Any = None
    ) -> FsdpJob:
        cmd = [sys.executable, "-m", "tests.children.fsdp_child", scenario, url, str(out), *args]
        env = {"CKPTFLOW_STORAGE_OPTIONS": json.dumps(storage_options)}
        return cls(cls.launch(cmd, world, out, env), out)

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

    def full(self) -> Any:
        """The digest of the job's full state (rank 0's ``full.json``)."""
        return json.loads((self.out / "full.json").read_text())

    def result(self, rank: int = 0) -> Any:
        return json.loads((self.out / f"result-r{rank}.json").read_text())


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
