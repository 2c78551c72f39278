"""The pipeline's parameters: a resume must match the stored run, and bad values fail before any work.

The run identity (spec, spec_config, seed) is stored as ``run.json`` beside the
checkpoints. Resuming with a different identity is refused before any epoch
is trained, naming each differing field, unless ``allow_config_change`` is
set; other fields (epochs, shards) may change freely. Invalid parameters fail
Prefect's parameter validation: the flow never starts, and the storage
location is not even created.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from prefect.exceptions import ParameterTypeError

from ckptflow.tasks.config import DEMO_SPEC
from ckptflow.tasks.steps import ConfigMismatchError
from tests.pipeline.helpers import (
    assert_only_committed,
    make_config,
    poll,
    run_flow,
    run_summary,
    task_runs,
)
from tests.pipeline.specs import EXTRA_HIDDEN_ENV, MARKED_SPEC, MARKERS_ENV, SPEC_CONFIG

pytestmark = pytest.mark.prefect


@pytest.fixture(scope="module")
def one_epoch_run(prefect_server, tmp_path_factory) -> Path:
    """A store holding epoch 1 of the reference config (seed 0, SPEC_CONFIG), made once."""
    root = tmp_path_factory.mktemp("reference") / "store"
    run_summary(make_config(root, epochs=1))
    return root


@pytest.fixture
def store(one_epoch_run, tmp_path) -> Path:
    """A private copy of the one-epoch store."""
    copy = tmp_path / "store"
    shutil.copytree(one_epoch_run, copy)
    return copy


@pytest.fixture
def markers(tmp_path, monkeypatch) -> Path:
    """Each epoch the spec starts leaves a marker here (the env var is not part of the run's identity)."""
    directory = tmp_path / "markers"
    directory.mkdir()
    monkeypatch.setenv(MARKERS_ENV, str(directory))
    return directory


class TestRunIdentity:
    @pytest.mark.parametrize(
        ("change", "named"),
        [
            ({"seed": 1}, "seed (0 -> 1)"),
            (
                {"spec_config": {**SPEC_CONFIG, "batch_size": 64, "dropout": 0.2}},
                "spec_config.batch_size (128 -> 64); spec_config.dropout (None -> 0.2)",
            ),
            ({"spec": DEMO_SPEC}, f"spec ({MARKED_SPEC!r} -> {DEMO_SPEC!r})"),
        ],
        ids=["seed", "spec_config", "spec"],
    )
    def test_changed_identity_is_refused_before_training(self, store, markers, change, named):
        run_json = (store / "run.json").read_bytes()
        state, run_id = run_flow(make_config(store, epochs=2, **change))

        assert state.is_failed()
        with pytest.raises(ConfigMismatchError) as err:
            state.result()
        assert named in str(err.value)
        assert "allow_config_change" in str(err.value)  # it says what the user can do
        assert list(markers.iterdir()) == []  # no epoch started
        assert assert_only_committed(store) == [1]
        assert (store / "run.json").read_bytes() == run_json

        # Through the API: init ran once (a config error is not worth retrying) and nothing after it.
        runs = poll(lambda: task_runs(run_id), lambda rs: rs and all(t.state.is_final() for t in rs))
        assert [(t.name.split("-")[0], t.run_count) for t in runs] == [("init_model", 1)]

    def test_allow_config_change_resumes(self, store):
        config = make_config(store, epochs=2, seed=1, allow_config_change=True)
        summary, _ = run_summary(config)

        assert summary["resumed_from"] == 1
        assert (summary["first_epoch"], summary["last_epoch"]) == (2, 2)
        assert assert_only_committed(store) == [1, 2]
        assert json.loads((store / "run.json").read_text()) == config.identity()
        # The new identity is now the run's: resuming with it needs no permission.
        summary, _ = run_summary(make_config(store, epochs=3, seed=1))
        assert summary["resumed_from"] == 2

    @pytest.mark.parametrize(
        ("how", "mode"),
        [("config", "in-process"), ("code", "in-process"), ("code", "trainers"), ("config", "2 ranks")],
    )
    def test_a_model_that_no_longer_fits_is_refused_once(self, store, markers, monkeypatch, how, mode):
        """Bug fix: a wider model (in the code, or a spec_config change let through) failed after
        33-38 s, as one multi-kilobyte line holding torch's whole size-mismatch list. With two
        ranks, the other rank failed first and ended the world before rank 0 answered, so init
        was retried (trainers started again) as if a rank had died. Now it fails at once, naming
        the first keys that differ and their shapes, and what to do; nothing committed is touched."""
        change: dict = {"spec_config": {**SPEC_CONFIG, "hidden": 48}, "allow_config_change": True}
        if how == "code":
            monkeypatch.setenv(EXTRA_HIDDEN_ENV, "16")  # the spec builds hidden 48 from the same config
            change = {}
        trainers = {"in-process": {}, "trainers": {"train_process": True}, "2 ranks": {"nproc": 2}}[mode]
        state, run_id = run_flow(make_config(store, epochs=2, **change, **trainers))

        assert state.is_failed()
        error = state.result(raise_on_failure=False)
        assert type(error).__name__ == "StateMismatchError", repr(error)
        message = str(error)
        lines = message.splitlines()
        assert lines[0] == f"version 1 of {store} does not fit the model the spec builds:", message
        assert "model: 3 tensors differ in shape: 0.weight saved [32, 64], built [48, 64]; " in message
        assert "0.bias saved [32], built [48]; 3.weight saved [10, 32], built [10, 48]" in message
        assert "new storage URL" in lines[-1], message  # what to do
        assert len(lines) <= 6 and len(message) < 800, message  # not torch's list
        assert "size mismatch for" not in message and "training ranks ended" not in message, message
        assert list(markers.iterdir()) == []  # no epoch started
        assert assert_only_committed(store) == [1]
        runs = poll(lambda: task_runs(run_id), lambda rs: rs and all(t.state.is_final() for t in rs))
        assert [(t.name.split("-")[0], t.run_count) for t in runs] == [("init_model", 1)]

    def test_harmless_changes_are_accepted(self, store, markers):
        summary, _ = run_summary(make_config(store, epochs=3, shards=3, save_every=1))

        assert summary["resumed_from"] == 1
        assert (summary["first_epoch"], summary["last_epoch"]) == (2, 3)
        assert sorted(p.name for p in markers.iterdir()) == ["epoch-2-started", "epoch-3-started"]
        assert assert_only_committed(store) == [1, 2, 3]


class TestBadParameters:
    @pytest.mark.parametrize(
        ("bad", "named"),
        [
            ({"epochs": 0}, "config.epochs: Input should be greater than or equal to 1"),
            ({"shards": 0}, "config.shards: Input should be greater than or equal to 1"),
            ({"bogus": 1}, "config.bogus: Extra inputs are not permitted"),
            ({"stop": {"patience": 2}}, "stop.target and stop.patience need stop.metric"),
            ({"stop": {"metric": "val_acc", "mode": "maximum"}}, "config.stop.mode"),
            ({"spec": "tests.pipeline.specs.MarkedDigitsSpec"}, "must look like 'package.module:ClassName'"),
            # issue 34: keep_best without best_mode silently meant min (the worst accuracy kept)
            (
                {"retention": {"keep_best": "val_acc"}},
                "retention.keep_best 'val_acc' needs retention.best_mode",
            ),
        ],
        ids=[
            "epochs-0",
            "shards-0",
            "unknown-field",
            "patience-without-metric",
            "bad-mode",
            "spec-no-colon",
            "keep-best-without-mode",
        ],
    )
    def test_invalid_parameters_fail_before_any_work(self, prefect_server, tmp_path, bad, named):
        storage = tmp_path / "never-created"
        state, _ = run_flow({"storage": str(storage), "spec": MARKED_SPEC, **bad})

        assert state.is_failed()
        with pytest.raises(ParameterTypeError) as err:
            state.result()
        assert named in str(err.value)
        assert not storage.exists()

    def test_maintenance_refuses_keep_best_without_a_direction(self, tmp_path):
        """Bug fix (issue 34): the maintenance flow's retention took the minimum when keep_best came
        without best_mode, pruning the best checkpoint by an accuracy every night."""
        from pydantic import ValidationError

        from ckptflow.tasks.maintenance import MaintenanceConfig

        with pytest.raises(
            ValidationError, match=r"retention\.keep_best 'val_acc' needs retention\.best_mode"
        ):
            MaintenanceConfig(storages=[str(tmp_path)], retention={"keep_best": "val_acc"})
        config = MaintenanceConfig(
            storages=[str(tmp_path)], retention={"keep_best": "val_acc", "best_mode": "max"}
        )
        assert config.retention.policy().best_mode == "max"
