"""A store's save, save_async and load of a state on a GPU: the bytes written are those the GPU
tensors held when the call was made, and a load fills GPU tensors in place."""

from __future__ import annotations

import numpy as np
import torch

from ckptflow.storage import CheckpointStore
from tests.conftest import assert_same_state

MIB = 1 << 20


def gpu_state() -> dict[str, torch.Tensor]:
    """~200 MiB on the GPU in tensors of several dtypes, a non-contiguous one and empty ones: big
    enough that the device-to-host copies are still running when a save returns."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    return {
        "big": torch.randn(40 * MIB // 4, device="cuda", generator=gen),
        "matrix": torch.randn(4096, 2048, device="cuda", generator=gen),
        "half": torch.randn(16 * MIB, device="cuda", generator=gen).to(torch.bfloat16),
        "strided": torch.randn(1024, 512, device="cuda", generator=gen).t(),
        "ints": torch.randint(0, 1 << 30, (1 << 20,), device="cuda", generator=gen),
        "empty": torch.empty(0, device="cuda"),
        "step": torch.tensor(7.0, device="cuda"),
    }


def on_host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu().clone() for k, v in state.items()}


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """``got`` (on any device) equals ``want`` bit for bit, keys in the same order."""
    assert_same_state(on_host(got), want)


def train_step(state: dict[str, torch.Tensor]) -> None:
    """What a training step does to the state: changes every tensor in place, on the GPU."""
    for tensor in state.values():
        if tensor.is_floating_point():
            tensor.mul_(0.5).add_(1)
        else:
            tensor.add_(1)


def test_save_async_writes_the_values_of_the_call_while_training_changes_them(tmp_path):
    state = gpu_state()
    expected = on_host(state)
    with CheckpointStore(tmp_path / "store") as store:
        first = store.save_async(state, step=1)
        train_step(state)  # at once: the copies to the host may still be on their way
        train_step(state)
        second_expected = on_host(state)
        v1 = first.wait().version
        second = store.save_async(state, step=2)  # reuses the first save's pinned buffer
        train_step(state)
        v2 = second.wait().version
        assert v2 == v1 + 1
        assert_bitwise(store.load(v1), expected)
        assert_bitwise(store.load(v2), second_expected)
        store.verify(v1)  # raises if a byte differs from its checksum
        store.verify(v2)


def test_a_save_of_gpu_tensors_reads_back_bitwise(tmp_path):
    """A plain save writes each blob once its own copy from the GPU ended (``stage_overlapped``)."""
    state = gpu_state()
    expected = on_host(state)
    with CheckpointStore(tmp_path / "store") as store:
        store.save(state)
        train_step(state)
        assert_bitwise(store.load(), expected)


def test_a_load_onto_the_gpu_gives_gpu_tensors(tmp_path):
    """Blobs up to 64 MiB go through pinned blocks, 64 MiB at a time; "big" (80 MiB) through a
    buffer of its own. Views of one tensor come back as views again; numpy arrays as arrays."""
    state = gpu_state()
    state["big"] = torch.randn(80 * MIB // 4, device="cuda")
    base = torch.arange(1000.0, device="cuda")
    saved = {**state, "head": base[:10], "tail": base[990:]}
    with CheckpointStore(tmp_path / "store") as store:
        store.save({**saved, "counts": np.arange(7)})
        loaded = store.load(map_location="cuda")
        assert loaded.pop("counts").tolist() == list(range(7))
        assert all(t.is_cuda for t in loaded.values())
        assert_bitwise(loaded, on_host(saved))
        assert loaded["head"].untyped_storage().data_ptr() == loaded["tail"].untyped_storage().data_ptr()
        model = store.load(keys=["matrix"], map_location="cuda")  # a part: only its blob read
        assert_bitwise(model, {"matrix": saved["matrix"].cpu()})


def test_a_load_into_a_gpu_models_state_fills_its_tensors_in_place(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    saved = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    with CheckpointStore(tmp_path / "store") as store:
        store.save({"model": model.state_dict()})
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        target = model.state_dict()
        loaded = store.load(into={"model": target})
    for key, tensor in loaded["model"].items():
        assert tensor is target[key], f"{key} came back as a new tensor"
        assert tensor.is_cuda
    assert_bitwise(model.state_dict(), saved)


def test_a_load_into_gpu_tensors_of_every_kind(tmp_path):
    """Contiguous GPU targets are read into through pinned memory; a non-contiguous one (here a
    parameter that requires grad) is filled from a copy; a target of another shape is left alone."""
    state = gpu_state()
    with CheckpointStore(tmp_path / "store") as store:
        store.save(state)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        target["strided"] = torch.nn.Parameter(torch.zeros_like(state["strided"]))  # non-contiguous
        target["ints"] = torch.zeros_like(state["ints"], device="cpu")
        other = target["matrix"] = torch.zeros(3, device="cuda")
        for map_location in ("cpu", "cuda"):
            loaded = store.load(into=target, map_location=map_location)
            for key in ("big", "half", "strided", "step"):
                assert loaded[key] is target[key], key
            assert loaded["matrix"] is not other and not other.any()
            assert loaded["matrix"].device.type == map_location
            assert_bitwise(loaded, on_host(state))
