"""FSDP2 on a GPU (one rank: NCCL for the model, gloo for the store): a sharded save of CUDA
DTensors, an async one that training races, and a two-rank CPU save loaded into a GPU model."""

from __future__ import annotations

import json

from tests.sharded.conftest import FsdpJob, Saved

CUDA = ("--device", "cuda")


def test_a_gpu_fsdp2_state_saves_and_loads_into_a_gpu_model_bitwise(tmp_path):
    url = str(tmp_path / "store")
    saved = FsdpJob.run("save", 1, url, tmp_path / "save", *CUDA)
    loaded = FsdpJob.run("load", 1, url, tmp_path / "load", *CUDA)
    assert loaded.full() == saved.full()
    assert loaded.result()["same_object"]


def test_save_async_of_a_gpu_fsdp2_state_holds_the_state_at_the_call(tmp_path):
    """The job trains two steps at once after each ``save_async`` returns; the versions hold the
    states at the calls (``full.json``, ``second.json``), the second in the first one's buffers."""
    url = str(tmp_path / "store")
    job = FsdpJob.run("save_async", 1, url, tmp_path / "save", *CUDA)
    assert (job.result()["version"], job.result()["second"]) == (1, 2)
    assert job.result()["after"]  # training went on: the live state differs from both
    for version, name in ((1, "full.json"), (2, "second.json")):
        loaded = FsdpJob.run("load", 1, url, tmp_path / f"load{version}", "--version", str(version), *CUDA)
        assert loaded.full() == json.loads((tmp_path / "save" / name).read_text()), name


def test_a_two_rank_cpu_save_loads_into_a_one_gpu_model(saved_by_store: Saved, tmp_path):
    loaded = FsdpJob.run("load", 1, saved_by_store.url, tmp_path / "load", *CUDA)
    assert loaded.full() == saved_by_store.full


def test_a_sharded_version_loads_whole_onto_the_gpu_in_one_process(saved_by_store: Saved):
    """No process group: every chunk put together into whole GPU tensors."""
    import torch

    from ckptflow.storage import CheckpointStore

    store = CheckpointStore(saved_by_store.url)
    on_cpu, on_gpu = store.load(), store.load(map_location="cuda")
    weights = on_gpu["model"]
    assert weights and all(t.is_cuda for t in weights.values())
    for key, tensor in on_cpu["model"].items():
        assert torch.equal(weights[key].cpu(), tensor), key
