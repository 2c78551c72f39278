"""The maintenance flow on a URL where nothing is stored fails, naming it, instead of reporting success.

The bug: maintenance (prune, gc, publish) of a mistyped store URL found "no
versions" and succeeded. The store commands' side is in tests/test_cli_errors.py.
"""

from __future__ import annotations

import pytest

from ckptflow.flows.maintenance import maintain_stores, publish_store_checkpoints
from ckptflow.storage import StorageUnavailableError
from ckptflow.tasks.maintenance import MaintenanceConfig

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
