"""The spec learns the run's epoch target (and other run facts) without them joining the run's identity.

The bug: a spec never learned how many epochs the run trains, so an LR
schedule sized in total steps (OneCycleLR) needed ``total_epochs`` in
``spec_config``, and "train longer" became a configuration change. Now every
mode sets ``spec.run`` (:class:`ckptflow.tasks.spec.RunFacts`) before
``build()``: in the flow's process, in the training process, and on every
rank. :class:`FactsSpec` writes what it was told into its metrics, so the
committed manifests show it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from ckptflow.flows.demo import DigitsSpec
from ckptflow.storage import CheckpointStore
from ckptflow.tasks.config import PipelineConfig
from ckptflow.tasks.spec import Trainable
from ckptflow.tasks.training.run_state import build_run, open_store
from tests.pipeline.helpers import REPO
from tests.pipeline.specs import SPEC_CONFIG

FACTS_SPEC = "tests.pipeline.test_run_facts:FactsSpec"
FACTS_DIR_ENV = "CKPTFLOW_TEST_FACTS_DIR"
CKPTFLOW = str(Path(sys.executable).parent / "ckptflow")


class FactsSpec(DigitsSpec):
    """DigitsSpec whose metrics say which run facts it was built and trained with."""

    def build(self) -> Trainable:
        self.built_for = self.run.epochs  # what an LR schedule sized in total steps would read
        directory = os.environ.get(FACTS_DIR_ENV)
        if directory:  # each process says what it was told, by rank
            (Path(directory) / f"rank-{self.run.rank}.json").write_text(json.dumps(asdict(self.run)))
        return super().build()

    def train_epoch(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        metrics = super().train_epoch(trainable, epoch)
        facts = self.run
        return {
            **metrics,
            "built_for": float(self.built_for),
            "target": float(facts.epochs),
            "planned": float(facts.planned_epochs),
            "save_every": float(facts.save_every),
            "world_size": float(facts.world_size),
            "rank": float(facts.rank),
            "storage_known": float(facts.storage == CheckpointStore(facts.storage).url),
        }


def facts_by_epoch(storage: Path) -> dict[int, dict[str, float]]:
    keys = ("built_for", "target", "planned", "save_every", "world_size", "rank", "storage_known")
    return {v.epoch: {k: v.metrics[k] for k in keys} for v in CheckpointStore(str(storage)).versions()}


def facts(
    target: float, *, world: float = 1.0, save_every: float = 1.0, planned: float | None = None
) -> dict[str, float]:
    return {
        "built_for": target,
        "target": target,
        "planned": target if planned is None else planned,
        "save_every": save_every,
        "world_size": world,
        "rank": 0.0,
        "storage_known": 1.0,
    }


def test_training_longer_is_the_same_run_and_the_spec_sees_the_new_target(prefect_server, tmp_path):
    """Through ``ckptflow run`` (a training process): --epochs 2, then --epochs 4 resumes it; the
    epochs the run was started for (``planned_epochs``) stay 2, so a schedule sized by them holds."""
    storage = tmp_path / "store"
    env = {**os.environ, **prefect_server.env(), "PYTHONPATH": str(REPO)}
    base = [CKPTFLOW, "run", "--storage", str(storage), "--spec", FACTS_SPEC, "--shards", "1"]
    base += ["--spec-config", json.dumps(SPEC_CONFIG)]
    for epochs in ("2", "4"):
        proc = subprocess.run(
            [*base, "--epochs", epochs], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "configuration" not in proc.stderr  # no change of configuration was reported
    longer = facts(4, planned=2)
    assert facts_by_epoch(storage) == {1: facts(2), 2: facts(2), 3: longer, 4: longer}
    stored = json.loads((storage / "run.json").read_text())
    assert "epochs" not in stored and stored["spec"] == FACTS_SPEC


def test_in_the_flows_process(tmp_path):
    from ckptflow.tasks.training.run_state import EpochAttempts, train_attempt

    config = PipelineConfig(
        storage=str(tmp_path / "store"), spec=FACTS_SPEC, spec_config=SPEC_CONFIG, epochs=7, save_every=3
    )
    run = build_run(config, open_store(config), info=lambda _: None, warn=lambda _: None)
    metrics = train_attempt(run, 1, EpochAttempts(run, keep_snapshot=False), lambda _: None).metrics
    assert metrics is not None
    assert {k: metrics[k] for k in facts(7)} == facts(7, save_every=3)


def test_on_every_rank(prefect_server, tmp_path, monkeypatch):
    """Two ranks launched by the flow (``nproc=2``): each spec is told its own rank."""
    from tests.pipeline.helpers import run_summary

    storage = tmp_path / "store"
    config = PipelineConfig(storage=str(storage), spec=FACTS_SPEC, spec_config=SPEC_CONFIG, epochs=2, nproc=2)
    monkeypatch.setenv(FACTS_DIR_ENV, str(tmp_path))
    summary, _ = run_summary(config)
    assert summary["last_epoch"] == 2
    assert facts_by_epoch(storage) == {1: facts(2, world=2), 2: facts(2, world=2)}  # rank 0's metrics
    for rank in (0, 1):
        told = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert told == {
            "epochs": 2,
            "planned_epochs": 2,
            "save_every": 1,
            "save_every_steps": None,
            "save_every_minutes": None,
            "world_size": 2,
            "rank": rank,
            "storage": str(storage),
        }
    assert json.loads((storage / "run.json").read_text()) == config.identity()
