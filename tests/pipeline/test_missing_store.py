"""The maintenance flow on a URL where nothing is stored fails, naming it, instead of reporting success;
a scheduled one (``skip_missing``, as the deployments set it) skips that store with a warning.

The bugs: maintenance (prune, gc, publish) of a mistyped store URL found "no
versions" and succeeded; and the deployments' nightly maintenance failed on
their default store when the user trained elsewhere. The store commands' side
is in tests/test_cli_errors.py.
"""

from __future__ import annotations

import pytest

from ckptflow.flows.maintenance import maintain_stores, publish_store_checkpoints
from ckptflow.storage import StorageUnavailableError
from ckptflow.tasks.maintenance import MaintenanceConfig
from tests.pipeline.helpers import REPO, poll

pytestmark = pytest.mark.prefect


def test_maintenance_of_a_missing_store_fails_and_creates_nothing(prefect_server, tmp_path):
    missing = tmp_path / "no-such-store"
    config = MaintenanceConfig(storages=[str(missing)], retention={"keep_last": 1})
    state = maintain_stores(config, return_state=True)

    assert state.is_failed()
    with pytest.raises(StorageUnavailableError, match=f"no store at {missing}"):
        state.result()
    assert not missing.exists()


def test_publishing_a_missing_store_fails(prefect_server, tmp_path):
    missing = tmp_path / "no-such-store"
    state = publish_store_checkpoints(str(missing), return_state=True)

    assert state.is_failed()
    with pytest.raises(StorageUnavailableError, match="no store at"):
        state.result()


def _deployed_maintenance_config() -> dict:
    """The ``config`` of the maintenance deployment in deployments/prefect.yaml, as its schedule runs it."""
    import yaml

    document = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    [deployment] = [d for d in document["deployments"] if d["name"] == "maintenance"]
    return deployment["parameters"]["config"]


def test_the_scheduled_maintenance_skips_a_store_not_there_yet(prefect_server, tmp_path, monkeypatch):
    """Bug fix (issue 34): the deployment's nightly maintenance failed with "no store at
    .../checkpoints/deployed" when the user trained elsewhere. A scheduled run skips a store that
    holds nothing yet, with a warning in its log, maintains the others, and completes."""
    import torch

    from ckptflow.storage import CheckpointStore
    from tests.pipeline.helpers import run_logs

    monkeypatch.chdir(tmp_path)  # the deployment's relative store path resolves here, as in its working_dir
    config = _deployed_maintenance_config()
    assert config["storages"] == ["./checkpoints/deployed"]
    trained = tmp_path / "trained-elsewhere"
    store = CheckpointStore(str(trained))
    for version in range(1, 8):
        store.save({"w": torch.full((2,), float(version))}, epoch=version, version=version)
    config = {**config, "storages": [*config["storages"], str(trained)], "publish": False}

    state = maintain_stores(config, return_state=True)

    assert state.is_completed(), state
    report = state.result()
    missing = tmp_path / "checkpoints" / "deployed"
    assert report[0]["storage"] == str(missing)
    assert report[0]["skipped"] == "nothing is stored there yet"
    assert report[1]["skipped"] is None and report[1]["pruned"] == [1, 2]
    assert [v.version for v in store.versions()] == [3, 4, 5, 6, 7]
    assert not (tmp_path / "checkpoints").exists()
    flow_run_id = state.state_details.flow_run_id
    warning = f"{missing}: skipped, nothing is stored there yet (a store appears with its first training run)"
    assert warning in poll(lambda: run_logs(flow_run_id), lambda logs: warning in logs)


def test_the_served_maintenance_skips_a_store_not_there_yet(tmp_path):
    """The same fix for deployments/serve.py's maintenance deployment (issue 34)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve", REPO / "deployments" / "serve.py")
    assert spec is not None and spec.loader is not None
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    deployments = serve.build_deployments(serve.parse_args(["--storage", str(tmp_path / "served")]))
    [maintenance] = [d for d in deployments if d.name == "maintenance-served"]
    assert maintenance.parameters["config"]["skip_missing"] is True
