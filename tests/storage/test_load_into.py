"""``load(into=state)``: tensors that match (path, dtype, shape) are filled and returned as the
very tensors given; anything else comes back new, with the saved values. (GPU targets: tests/cuda.)"""

from __future__ import annotations

from pathlib import Path

import pytest
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


def test_an_optimizer_saved_by_number_into_a_state_by_name_is_said_and_loads_through_torch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A version of ``opt.state_dict()`` (parameters by number) loaded ``into`` get_state_dict's layout
    (by name) left the state to fill as it was without a word. It is said, with the way that works:
    torch's set_state_dict takes what load() returns."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    store = CheckpointStore(tmp_path / "s")
    store.save({"model": model.state_dict(), "optimizer": opt.state_dict()})
    saved = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    msd, osd = get_state_dict(fresh, fresh_opt)
    with caplog.at_level("WARNING", logger="ckptflow"):
        state = store.load(into={"model": msd, "optimizer": osd})
    said = [r.getMessage() for r in caplog.records if "holds no tensor" in r.getMessage()]
    assert len(said) == 1 and "by parameter number" in said[0] and "set_state_dict" in said[0], said
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for number, exp_avg in saved.items():
        assert torch.equal(fresh_opt.state_dict()["state"][number]["exp_avg"], exp_avg)
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
