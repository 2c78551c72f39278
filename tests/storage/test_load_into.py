"""``load(into=state)``: tensors that match (path, dtype, shape) are filled and returned as the
very tensors given; anything else comes back new, with the saved values. (GPU targets: tests/cuda.)"""

from __future__ import annotations

import torch

from ckptflow.storage import CheckpointStore
from tests.conftest import assert_same_state


def saved_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(64, 32, generator=gen),
        "b": torch.randn(32, generator=gen),
        "steps": torch.arange(10),
        "t": torch.randn(8, 4, generator=gen).t(),  # saved as a non-contiguous view
    }


def test_matching_cpu_tensors_are_filled_in_place_and_returned(tmp_path):
    state = saved_state()
    store = CheckpointStore(tmp_path)
    store.save(state)
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    loaded = store.load(into=target)
    for key in ("w", "b", "steps"):
        assert loaded[key] is target[key], key
    assert_same_state(loaded, state)
    assert_same_state(target["w"], state["w"])


def test_targets_that_do_not_match_are_left_alone(tmp_path):
    state = saved_state()
    store = CheckpointStore(tmp_path)
    store.save(state)
    target = {"w": torch.zeros(3), "b": torch.zeros(32, dtype=torch.float64), "steps": None}
    loaded = store.load(into=target)
    assert loaded["w"] is not target["w"] and not target["w"].any()
    assert loaded["b"] is not target["b"] and not target["b"].any()
    assert_same_state(loaded, state)


def test_meta_targets_get_the_saved_values_back_not_meta_tensors(tmp_path):
    """A model built on the meta device (no memory yet) hands meta tensors: copying into one keeps
    nothing, so the load returns real tensors with the saved values instead."""
    state = saved_state()
    store = CheckpointStore(tmp_path)
    store.save(state)
    target = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    loaded = store.load(into=target)
    assert all(t.device.type == "cpu" for t in loaded.values())
    assert_same_state(loaded, state)
