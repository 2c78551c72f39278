"""The ``ckptflow`` console script run as a user runs it, for the tests of what it says.

A script outside the working directory (so ``sys.path[0]`` is not the cwd) starts the console
script's entry point in a directory of the test's own, with no Prefect API configured; it records
the modules the process imported, to show that a refused command never imported Prefect.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import S3_SECRET

SECONDS = 10.0  # "within a few seconds", with room for a loaded machine
LAUNCHER = """\
import atexit, os, sys
atexit.register(lambda: open(os.environ["CKPTFLOW_TEST_MODULES"], "w").write("\\n".join(sys.modules)))
from ckptflow.flows.launch import main
sys.argv[0] = "ckptflow"
main()
"""


class Result:
    def __init__(self, proc: subprocess.CompletedProcess[str], seconds: float, modules: set[str]) -> None:
        self.returncode, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr
        self.seconds = seconds
        self.modules = modules

    def assert_one_error_line(self, *fragments: str, seconds: float = SECONDS, code: int = 1) -> str:
        lines = self.stderr.splitlines()
        assert self.returncode == code, (self.returncode, self.stderr[-3000:])
        assert "Traceback" not in self.stderr, self.stderr[-3000:]
        assert len(lines) == 1, self.stderr[-3000:]
        assert lines[0].startswith("error: "), lines[0]
        for fragment in fragments:
            assert fragment in lines[0], lines[0]
        assert S3_SECRET not in self.stdout + self.stderr
        assert self.seconds < seconds, f"took {self.seconds:.1f}s: {lines[0]}"
        return lines[0]


@pytest.fixture
def ckptflow(tmp_path: Path):
    """Run ``ckptflow ARGS`` in ``tmp_path/work`` with no Prefect API configured; return a Result."""
    script = tmp_path / "bin" / "ckptflow_launcher.py"
    script.parent.mkdir()
    script.write_text(LAUNCHER)
    work = tmp_path / "work"
    work.mkdir()

    def run(*args: str, env: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> Result:
        modules = tmp_path / f"modules-{uuid.uuid4().hex}"
        full = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PREFECT_")}
        full.update(
            PREFECT_HOME=str(tmp_path / "prefect-home"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
            CKPTFLOW_TEST_MODULES=str(modules),
            COLUMNS="200",
            **(env or {}),
        )
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, str(script), *args],
            cwd=work,
            env=full,
            capture_output=True,
            text=True,
            timeout=300,
        )
        seconds = time.monotonic() - started
        names = set(modules.read_text().split()) if modules.exists() else set()
        return Result(proc, seconds, names)

    run.work = work  # type: ignore[attr-defined]
    run.prefect_home = tmp_path / "prefect-home"  # type: ignore[attr-defined]
    return run


def assert_prefect_never_started(ckptflow: Any, result: Result) -> None:
    assert result.modules, "the launcher did not record its modules"
    assert "prefect" not in result.modules  # no Prefect client: no flow run
    assert not ckptflow.prefect_home.exists()  # no temporary API server (it creates PREFECT_HOME)
