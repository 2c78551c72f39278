"""Sharded state round trips: FSDP2 saved at one world size loads at any other, bitwise.

The reference is the job's full state (model and Adam state: ``step``, ``exp_avg``,
``exp_avg_sq``, and the ``param_groups``), gathered with ``full_state_dict=True``: what a load
puts into a freshly built, differently initialised model must gather to the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptflow.storage import CheckpointStore
from ckptflow.storage.format.manifest import parse_manifest
from tests.sharded.conftest import FsdpJob, Saved, digest

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_two_rank_save_loads_at_any_world_size(saved_by_store: Saved, tmp_path: Path, world: int) -> None:
    job = FsdpJob.run("load", world, saved_by_store.url, tmp_path / "load")
    assert job.full() == saved_by_store.full
    assert job.result()["same_object"], "load(into=state) returns the state it filled"


def test_stateful_objects_take_their_state_at_another_world_size(
    saved_by_store: Saved, tmp_path: Path
) -> None:
    """DCP ``Stateful`` wrappers of the model and the optimizer, whose ``state_dict`` gives copies,
    get their state through ``load_state_dict`` (``set_model_state_dict`` /
    ``set_optimizer_state_dict``) once every rank has read its part, at W=3 from a W=2 save."""
    job = FsdpJob.run("load", 3, saved_by_store.url, tmp_path / "load", "--stateful")
    assert job.full() == saved_by_store.full
    assert job.result()["applied"] == ["model", "optimizer"], "in DCP's order: the keys sorted"


def test_one_process_without_a_process_group_gets_the_full_state(saved_by_store: Saved) -> None:
    state = CheckpointStore(saved_by_store.url).load()
    assert digest(state) == saved_by_store.full
    groups = state["optimizer"]["param_groups"]
    assert groups[0]["lr"] == pytest.approx(1e-2) and tuple(groups[0]["betas"]) == (0.9, 0.999)
    assert "blocks.0.up.weight" in state["model"], "keys with dots stay whole keys"


def test_the_manifest_written_is_what_the_manifest_schema_writes(saved_by_store: Saved) -> None:
    """The sharded save builds its entries as JSON (chunked tensors, blobs with pieces, the ranks'
    own states): its bytes are exactly those the schema validates and writes back."""
    path = Path(saved_by_store.url) / f"v{saved_by_store.version:06d}" / "manifest.json"
    data = path.read_bytes()
    manifest = parse_manifest(data, str(path))
    assert manifest.chunked and manifest.ranks and any(b.pieces for b in manifest.blobs)
    assert manifest.to_json() == data


def test_diff_tells_chunked_tensors_apart_by_their_checksums(saved_by_store: Saved, tmp_path: Path) -> None:
    """A version against itself: every chunk's checksum matches, nothing is read. Against a torch
    file of its full state (one tensor each, where the store holds chunks): both are read and
    compared, and nothing differs; a changed element is found."""
    store = CheckpointStore(saved_by_store.url)
    version = saved_by_store.version
    same = store.diff(version, version)
    assert same.is_empty() and same.unchanged == len(store.manifest(version).chunked) > 0
    state = store.load(version)
    torch.save(state, tmp_path / "full.pt")
    assert store.diff(version, tmp_path / "full.pt").changes == []
    state["model"]["blocks.0.up.weight"][0, 0] += 1
    torch.save(state, tmp_path / "changed.pt")
    changed = store.diff(version, tmp_path / "changed.pt")
    assert [(c.path, c.kind) for c in changed.changes] == [("model/blocks.0.up.weight", "values")]


def test_the_unfilled_model_really_differs(saved_by_store: Saved, tmp_path: Path) -> None:
    """The load tests start from another seed: a load that filled nothing would fail them."""
    job = FsdpJob.run("fresh", 2, saved_by_store.url, tmp_path / "fresh")
    assert job.full()["model"] != saved_by_store.full["model"]


class TestDcpInterop:
    def test_dcp_save_writes_a_committed_version(self, saved_by_dcp: Saved) -> None:
        store = CheckpointStore(saved_by_dcp.url)
        (info,) = store.versions()
        assert (info.version, info.epoch, info.metrics) == (saved_by_dcp.version, 1, {"loss": 1.5})
        store.verify(info.version)
        assert digest(store.load()) == saved_by_dcp.full

    def test_dcp_load_reads_a_store_save(self, saved_by_store: Saved, tmp_path: Path) -> None:
        job = FsdpJob.run("dcp_load", 3, saved_by_store.url, tmp_path / "load")
        assert job.full() == saved_by_store.full

    def test_store_load_reads_a_dcp_save(self, saved_by_dcp: Saved, tmp_path: Path) -> None:
        job = FsdpJob.run("load", 2, saved_by_dcp.url, tmp_path / "load")
        assert job.full() == saved_by_dcp.full


def test_a_2d_mesh_save_loads_into_a_1d_mesh(tmp_path: Path) -> None:
    """FSDP x TP on a 2x2 mesh (4 ranks), loaded by FSDP alone on 2 ranks and by one process."""
    store = tmp_path / "store"
    saved = FsdpJob.run("save", 4, str(store), tmp_path / "save", "--mesh", "2d")
    loaded = FsdpJob.run("load", 2, str(store), tmp_path / "load")
    assert loaded.full() == saved.full()
    assert digest(CheckpointStore(str(store)).load()) == saved.full()


def test_save_async_keeps_the_state_of_its_call(tmp_path: Path) -> None:
    """Training goes on while the background write runs: the version holds the state at the call."""
    store = tmp_path / "store"
    saved = FsdpJob.run("save_async", 2, str(store), tmp_path / "save")
    assert saved.result()["after"], "the training steps after the call changed the model"
    loaded = FsdpJob.run("load", 3, str(store), tmp_path / "load", "--version", "1")
    assert loaded.full() == saved.full()
    assert digest(CheckpointStore(str(store)).load(1)) == saved.full()
    second = json.loads((tmp_path / "save" / "second.json").read_text())
    assert second != saved.full()
    assert digest(CheckpointStore(str(store)).load(2)) == second, (
        "the reused host copy holds the second state"
    )
    # The ranks of a load look for the newest version at the same time: if a save commits in
    # between, they all take the newest any of them saw (rank 0 saw 1, rank 1 saw 2).
    raced = FsdpJob.run("load", 2, str(store), tmp_path / "raced", "--rank0-looks-early")
    assert raced.full() == second


@pytest.mark.s3
def test_on_s3_a_two_rank_save_loads_at_three_ranks_and_in_one_process(
    s3_bucket: tuple[str, dict], tmp_path: Path
) -> None:
    bucket, options = s3_bucket
    url = f"s3://{bucket}/fsdp"
    saved = FsdpJob.run("save", 2, url, tmp_path / "save", storage_options=options)
    loaded = FsdpJob.run("load", 3, url, tmp_path / "load", storage_options=options)
    assert loaded.full() == saved.full()
    store = CheckpointStore(url, storage_options=options)
    store.verify()
    assert digest(store.load()) == saved.full()


def test_each_rank_gets_its_own_rank_state_back(saved_by_store: Saved) -> None:
    from tests.children.fsdp_child import own_state

    store = CheckpointStore(saved_by_store.url)
    assert store.manifest().world_size == 2
    for rank in (0, 1):
        got = store.load_rank_state(rank=rank, world_size=2)
        want = own_state(rank)
        assert (got["rank"], got["cursor"]) == (want["rank"], want["cursor"])
        assert torch.equal(got["perm"], want["perm"])
    assert "rank" not in store.load(), "the ranks' own states stay apart from the state"
