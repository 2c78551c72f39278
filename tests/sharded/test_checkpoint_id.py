"""DCP's ``checkpoint_id`` with a store's writer and reader: it names a version (a number, a version
directory's name, or its path or URL inside the store), or it is refused; never ignored."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptflow.storage import CheckpointError, CheckpointStore, VersionNotFoundError


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), value), "b": torch.full((4,), value)}


@pytest.fixture(autouse=True)
def _one_process() -> None:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def test_a_save_writes_the_version_its_checkpoint_id_names(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = CheckpointStore(root)
    dcp.save(state(1.0), checkpoint_id=5, storage_writer=store.dcp_writer(), no_dist=True)
    dcp.save(state(2.0), checkpoint_id=str(root / "v000007"), storage_writer=store.dcp_writer(), no_dist=True)
    dcp.save(state(3.0), checkpoint_id="v000009", storage_writer=store.dcp_writer(), no_dist=True)
    assert [v.version for v in store.versions()] == [5, 7, 9]
    assert torch.equal(store.load(version=7)["w"], state(2.0)["w"])


def test_a_save_refuses_a_checkpoint_id_that_names_no_version_of_the_store(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "s")
    for wrong in (str(tmp_path / "elsewhere" / "step_100"), str(tmp_path / "other" / "v000001"), "step_100"):
        with pytest.raises(
            CheckpointError, match=r"checkpoint_id .* names no version of .*give a version number"
        ):
            dcp.save(state(1.0), checkpoint_id=wrong, storage_writer=store.dcp_writer(), no_dist=True)
    with pytest.raises(CheckpointError, match=r"names version 4, but this writer saves version 3"):
        dcp.save(state(1.0), checkpoint_id=4, storage_writer=store.dcp_writer(version=3), no_dist=True)
    assert store.versions() == []


def test_a_load_reads_the_version_its_checkpoint_id_names(tmp_path: Path) -> None:
    """Bug: ``dcp.load(checkpoint_id=X, storage_reader=store.dcp_reader())`` ignored X: a load naming
    a version that does not exist returned the newest version, without a word."""
    root = tmp_path / "s"
    store = CheckpointStore(root)
    for value in (1.0, 2.0, 3.0):
        store.save(state(value))
    target = state(0.0)
    dcp.load(target, checkpoint_id=1, storage_reader=store.dcp_reader(), no_dist=True)
    assert torch.equal(target["w"], state(2.0)["w"])
    dcp.load(target, checkpoint_id=str(root / "v000000"), storage_reader=store.dcp_reader(), no_dist=True)
    assert torch.equal(target["w"], state(1.0)["w"])
    target = state(0.0)
    with pytest.raises(VersionNotFoundError, match="99"):
        dcp.load(target, checkpoint_id=str(root / "v000099"), storage_reader=store.dcp_reader(), no_dist=True)
    with pytest.raises(CheckpointError, match="names no version"):
        dcp.load(
            target, checkpoint_id=str(tmp_path / "nope"), storage_reader=store.dcp_reader(), no_dist=True
        )
    assert torch.equal(target["w"], state(0.0)["w"])  # nothing was read


def test_one_writer_reset_with_another_checkpoint_id_writes_each(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "s")
    writer = store.dcp_writer()
    dcp.save(state(1.0), checkpoint_id=3, storage_writer=writer, no_dist=True)
    dcp.save(state(2.0), checkpoint_id=4, storage_writer=writer, no_dist=True)
    assert [v.version for v in store.versions()] == [3, 4]
