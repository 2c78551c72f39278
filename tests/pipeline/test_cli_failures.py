"""A run that fails inside the flow ends with one ``error:`` line and no traceback, and poisons nothing.

The bugs: a spec that failed to build printed Prefect's tracebacks (72 lines
and more) instead of the one line the README promises, and left ``run.json``
behind, so that the corrected command was refused as a configuration change.
Tracebacks stay available with ``--verbose`` (and in the run's logs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.pipeline.helpers import REPO
from tests.pipeline.specs import SPEC_CONFIG

CKPTFLOW = str(Path(sys.executable).parent / "ckptflow")


def test_a_spec_that_fails_to_build_then_the_corrected_command(prefect_server, tmp_path):
    storage = tmp_path / "store"
    env = {**os.environ, **prefect_server.env(), "PYTHONPATH": str(REPO)}
    base = [CKPTFLOW, "run", "--storage", str(storage), "--epochs", "1", "--shards", "1"]
    base += ["--spec-config", json.dumps(SPEC_CONFIG)]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)

    failed = run("--spec", "tests.test_run_identity:BuildFails")
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert failed.stderr.splitlines()[-1] == "error: BuildFailure: cannot build on purpose"
    assert not (storage / "run.json").exists()

    corrected = run("--spec", "tests.pipeline.specs:MarkedDigitsSpec")
    assert corrected.returncode == 0, corrected.stderr[-3000:]
    assert json.loads((storage / "run.json").read_text())["spec"] == "tests.pipeline.specs:MarkedDigitsSpec"
