"""Lineage through the pipeline: every version records its parent, its flow run, the spec, a hash
of the run's config and the git commit of the spec's code; a resumed run continues the chain from
the version it resumed, a fork from an older version shows in ``ckptflow log``, and the committed
event carries the parent. Real flow runs on a real Prefect server.
"""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.tasks.training.lineage import code_commit, config_hash
from tests.pipeline.helpers import committed_events, make_config, open_store, poll, run_summary

REPO_COMMIT = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def test_runs_record_their_lineage_and_a_resume_continues_the_chain(prefect_server, tmp_path):
    config = make_config(tmp_path / "store", epochs=2)
    _, first_run = run_summary(config)
    _, second_run = run_summary(config.model_copy(update={"epochs": 3}))  # resumes after epoch 2
    versions = open_store(config).versions()
    assert [(v.version, v.parent) for v in versions] == [(1, None), (2, 1), (3, 2)]
    runs = [v.lineage.get("run") for v in versions]
    assert runs == [str(first_run), str(first_run), str(second_run)]
    for v in versions:
        assert v.lineage["spec"] == config.spec and v.lineage["config_hash"] == config_hash(config)
    spec_commit = code_commit(config.spec.partition(":")[0])
    if REPO_COMMIT:  # the demo spec lives in this repository's checkout
        assert spec_commit == REPO_COMMIT and versions[0].lineage["code"] == {"git": REPO_COMMIT}
    events = poll(lambda: committed_events(open_store(config).url), lambda evs: len(evs) >= 3, timeout=30)
    assert {e.payload["version"]: e.payload["parent"] for e in events} == {1: None, 2: 1, 3: 2}

    log = CliRunner().invoke(app, ["log", str(tmp_path / "store"), "--json"])
    assert log.exit_code == 0, log.output
    notes = {v["version"]: v["note"] for v in json.loads(log.output)["versions"]}
    assert notes == {1: None, 2: None, 3: "a new run"}


def test_a_fork_from_an_older_version_shows_in_the_log(prefect_server, tmp_path):
    """A run resumed from version 1 while version 2 exists (a user loads v1, trains on, and
    saves): its version's parent is 1, and ``ckptflow log`` names the fork."""
    config = make_config(tmp_path / "store", epochs=2)
    run_summary(config)
    store = open_store(config)
    state = store.load(1)
    info = store.save(state, epoch=3)
    assert info.parent == 1
    result = CliRunner().invoke(app, ["log", str(tmp_path / "store")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    line = next(row for row in result.output.splitlines() if row.strip("│ ").startswith("3 "))
    assert "fork: from version 1, not 2" in line, result.output


def test_the_lineage_module_needs_no_prefect():
    """Trainers compute the lineage in every rank: it must not import Prefect."""
    code = "import sys, ckptflow.tasks.training.lineage; print('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
