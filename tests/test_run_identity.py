"""``run.json`` is written only once a run is built and restored; an empty store never refuses a run.

The bug: the run's identity was written before the spec was imported, so a
spec that failed (a typo, a build error, a failing ``--allow-config-change``)
left a ``run.json`` behind, and the corrected command was then refused as a
configuration change on a store with no checkpoints. These tests build runs
the way every mode does (:func:`ckptflow.tasks.training.run_state.build_run`, in this
process and in a training process), without Prefect.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptflow.flows.demo import DigitsSpec
from ckptflow.storage import CheckpointStore
from ckptflow.tasks.config import PipelineConfig
from ckptflow.tasks.spec import Trainable
from ckptflow.tasks.training.run_state import ConfigMismatchError, build_run, capture_run, open_store

CONFIG = {"hidden": 16, "batch_size": 256}
GOOD = "ckptflow.flows.demo:DigitsSpec"
BUILD_FAILS = "tests.test_run_identity:BuildFails"
RESTORE_FAILS = "tests.test_run_identity:RestoreFails"


class BuildFailure(RuntimeError):
    pass


class BuildFails(DigitsSpec):
    """A spec that imports but cannot build its model."""

    def build(self) -> Trainable:
        raise BuildFailure("cannot build on purpose")


class RestoreFails(DigitsSpec):
    """A spec whose model does not take the stored state (say, a changed layer)."""

    def load_state_dict(self, state: Any) -> None:
        raise BuildFailure("cannot restore on purpose")


def config(storage: Path, **fields: Any) -> PipelineConfig:
    fields.setdefault("spec", GOOD)
    fields.setdefault("spec_config", dict(CONFIG))
    return PipelineConfig(storage=str(storage), shards=1, **fields)


def build(cfg: PipelineConfig) -> Any:
    notes: list[str] = []
    return build_run(cfg, open_store(cfg), info=notes.append, warn=notes.append)


def run_json(storage: Path) -> dict[str, Any] | None:
    path = storage / "run.json"
    return json.loads(path.read_text()) if path.exists() else None


def commit_epoch_1(storage: Path, **fields: Any) -> None:
    """A store holding epoch 1 of a run of ``fields``."""
    run = build(config(storage, **fields))
    run.epoch = 1
    run.store.save(capture_run(run), epoch=1, step=0, version=1)


class TestFailedBuildsLeaveNoIdentity:
    @pytest.mark.parametrize("spec", ["tests.test_run_identity:NoSuchSpec", BUILD_FAILS])
    def test_a_spec_that_fails_then_the_corrected_command_runs(self, tmp_path, spec):
        storage = tmp_path / "store"
        with pytest.raises(Exception) as err:
            build(config(storage, spec=spec))
        assert "NoSuchSpec" in str(err.value) or isinstance(err.value, BuildFailure)
        assert run_json(storage) is None

        run = build(config(storage))  # the corrected command
        assert run.epoch == 0
        assert run_json(storage) == config(storage).identity()

    def test_a_failing_allow_config_change_keeps_the_stored_identity(self, tmp_path):
        storage = tmp_path / "store"
        commit_epoch_1(storage)
        before = run_json(storage)
        assert before == config(storage).identity()

        changed = config(storage, spec=RESTORE_FAILS, seed=3, allow_config_change=True)
        with pytest.raises(BuildFailure):
            build(changed)
        assert run_json(storage) == before

        run = build(config(storage))  # the original command still resumes, without permission
        assert run.epoch == 1
        with pytest.raises(ConfigMismatchError, match=r"seed \(0 -> 3\)"):
            build(config(storage, seed=3))  # a store with a committed version still refuses

    def test_the_training_process_writes_nothing_for_a_failed_build(self, tmp_path):
        from ckptflow.tasks.training.trainer import TrainerProcess

        storage = tmp_path / "store"
        process = TrainerProcess().start(config(storage, spec=BUILD_FAILS), {})
        try:
            with pytest.raises(Exception, match="cannot build on purpose"):
                process.built().result(timeout=120)
        finally:
            process.close(interrupted=True)
        assert run_json(storage) is None


class TestNothingCommittedNeverRefuses:
    def test_a_stale_identity_without_checkpoints_is_replaced(self, tmp_path):
        storage = tmp_path / "store"
        storage.mkdir()
        stale = {"spec": "typo.module:Spec", "spec_config": {"lr": 1}, "seed": 9}
        (storage / "run.json").write_text(json.dumps(stale))

        run = build(config(storage))
        assert run.epoch == 0
        assert run_json(storage) == config(storage).identity()
        assert CheckpointStore(str(storage)).versions() == []
