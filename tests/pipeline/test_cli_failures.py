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


def test_a_new_store_is_announced_and_resume_only_refuses_one(prefect_server, tmp_path):
    """Bug fixed: a mistyped --storage trained from scratch without a word (a resume prints "resuming
    in ..."; a new store printed nothing), and nothing let a user require a resume."""
    env = {**os.environ, **prefect_server.env(), "PYTHONPATH": str(REPO)}
    storage = tmp_path / "store"
    base = [CKPTFLOW, "run", "--storage", str(storage), "--epochs", "1", "--shards", "1"]
    base += ["--spec", "tests.pipeline.specs:MarkedDigitsSpec", "--spec-config", json.dumps(SPEC_CONFIG)]

    def run(*args: str, where: Path = storage) -> subprocess.CompletedProcess[str]:
        command = [*base, *args]
        command[command.index("--storage") + 1] = str(where)
        return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)

    mistyped = tmp_path / "stroe"
    refused = run("--resume-only", where=mistyped)
    assert refused.returncode == 1, refused.stderr[-3000:]
    last = refused.stderr.splitlines()[-1]
    assert last.startswith(f"error: nothing to resume in {mistyped}:"), refused.stderr[-3000:]
    assert "--resume-only" in last and "Traceback" not in refused.stderr
    assert not mistyped.exists()  # nothing created at the mistyped URL

    new = run()
    assert new.returncode == 0, new.stderr[-3000:]
    assert f"starting a new store in {storage}: no committed checkpoint there" in " ".join(new.stderr.split())

    resumed = run("--resume-only", "--epochs", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "starting a new store" not in resumed.stderr and "resuming from version" in resumed.stderr


def test_resume_only_in_a_deployment_fails_the_run_before_anything_is_written(prefect_server, tmp_path):
    """The flow's parameter, for scheduled deployments: a missing store fails the run at once
    (no retries, no lease or directory left behind)."""
    from tests.pipeline.helpers import make_config, run_flow

    config = make_config(tmp_path / "missing", epochs=1, resume_only=True)
    state, _ = run_flow(config)
    assert state.is_failed() and "nothing to resume in" in state.message, state.message
    assert not (tmp_path / "missing").exists()
