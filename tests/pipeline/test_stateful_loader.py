"""Exact mid-epoch resume with torchdata's ``StatefulDataLoader`` in ``Trainable.extras``.

The loader's ``state_dict`` (ints, a bool, Nones and its sampler's generator state, a uint8
tensor) is saved as it is with the rest of the run, and the spec's ``train_steps`` ignores
``start``: the restored loader goes on from its position by itself. A run resumed from a save
inside epoch 2 must end bit for bit where a straight run ends, in the flow's process and in a
training process; the same run with the loader left out of ``extras`` must not (the check can
fail: the resumed run replays the epoch's first batches). The README's example spec runs as
written, and the loader-level test pins why it shuffles with a sampler of its own.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ckptflow.storage import CheckpointStore
from tests.conftest import assert_same_state
from tests.pipeline.helpers import make_config, readme_module, run_summary
from tests.pipeline.specs import LOADER_LEFT_OUT_SPEC, LOADER_SPEC
from tests.pipeline.test_step_checkpoints import (
    EPOCHS,
    EVERY,
    assert_same_run,
    at_step,
    expected_positions,
    positions,
)

pytestmark = pytest.mark.prefect

BATCH = 128  # SPEC_CONFIG's: 1,438 training samples make 12 batches an epoch, the last of 30
LATER = [20, 24, 25, 30, 35, 36]  # every save after the cut (step 15: epoch 2, 3 steps in)


def loader_run(storage: Path, spec: str = LOADER_SPEC, **fields):  # type: ignore[no-untyped-def]
    return make_config(storage, spec=spec, epochs=EPOCHS, save_every_steps=EVERY, **fields)


def resumed_at_step_15(tmp_path: Path, spec: str, **fields) -> tuple[CheckpointStore, CheckpointStore]:  # type: ignore[no-untyped-def]
    """(a straight run's store, the store of the same run resumed from its save at step 15)."""
    straight = loader_run(tmp_path / "A", spec, **fields)
    resumed = loader_run(tmp_path / "B", spec, **fields)
    run_summary(straight)
    run_summary(resumed)
    b = CheckpointStore(resumed.storage)
    cut = at_step(b, 15)
    assert (cut.epoch, cut.in_epoch) == (2, 3)
    for v in b.versions():
        if v.version > cut.version:
            b.delete(v.version)
    summary, _ = run_summary(resumed)
    assert summary["resumed_from"] == cut.version
    return CheckpointStore(straight.storage), b


@pytest.mark.parametrize("train_process", [False, True], ids=["in-process", "trainer-process"])
def test_a_run_resumed_inside_an_epoch_ends_where_a_straight_run_ends(
    prefect_server, tmp_path, train_process
):
    straight, resumed = resumed_at_step_15(tmp_path, LOADER_SPEC, train_process=train_process)
    saved = resumed.load(at_step(resumed, 15).version)["extras"]["loader"]
    assert saved["_num_yielded"] == 3 and saved["_iterator_finished"] is False, saved
    assert saved["_sampler_iter_state"]["samples_yielded"] == 3 * BATCH, saved
    assert positions(resumed) == expected_positions()
    assert_same_run(resumed, straight, LATER)


def test_a_loader_left_out_of_extras_replays_the_epoch_and_the_check_fails(prefect_server, tmp_path):
    straight, resumed = resumed_at_step_15(tmp_path, LOADER_LEFT_OUT_SPEC, train_process=False)
    assert "extras" not in resumed.load(at_step(resumed, 15).version)
    assert positions(straight) == expected_positions()
    with pytest.raises(AssertionError, match="tensor bytes differ"):
        assert_same_run(resumed, straight, [20])


README_MARKER = "<!-- tests/pipeline/test_stateful_loader.py runs the next code block as written -->"


@pytest.fixture
def readme_loader_spec(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The README's StatefulDataLoader spec, as written, as module ``readme_loader``."""
    readme_module(README_MARKER, "readme_loader", tmp_path, monkeypatch)
    yield "readme_loader:MyLoaderSpec"
    sys.modules.pop("readme_loader", None)


def test_the_readme_loader_spec_resumes_inside_an_epoch_bitwise(prefect_server, tmp_path, readme_loader_spec):
    """The README's example: 64 steps an epoch, a save every 10; resumed from the save at step 90
    (inside epoch 2), it ends as the straight run ends."""
    straight = make_config(
        tmp_path / "A", spec=readme_loader_spec, spec_config={}, epochs=2, save_every_steps=10
    )
    resumed = straight.model_copy(update={"storage": str(tmp_path / "B")})
    run_summary(straight)
    run_summary(resumed)
    b = CheckpointStore(resumed.storage)
    cut = at_step(b, 90)
    assert (cut.epoch, cut.in_epoch, cut.epoch_steps) == (2, 26, 64)
    for v in b.versions():
        if v.version > cut.version:
            b.delete(v.version)
    summary, _ = run_summary(resumed)
    assert summary["resumed_from"] == cut.version
    a = CheckpointStore(straight.storage)
    for step in [100, 120, 128]:  # not assert_same_run: it wants a scheduler, which the example has not
        got, want = b.load(at_step(b, step).version), a.load(at_step(a, step).version)
        assert set(want) == {"model", "optimizer", "extras", "spec", "rng", "progress"}
        for state in (got, want):
            state["rng"].pop("python")  # Prefect's threads draw from it (see assert_same_checkpoint)
        assert_same_state(got, want)


def epochs_of(loader, epochs: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [[int(i) for (batch,) in loader for i in batch] for _ in range(epochs)]


@pytest.mark.parametrize("shuffle", ["shuffle=True", "own sampler"])
def test_which_shuffle_resumes_the_epochs_after_the_resumed_one(shuffle):
    """torchdata 0.11: with ``shuffle=True, generator=g`` a loader restored in mid-epoch ends that
    epoch right, but ``g`` one draw behind (the iterator draws its base seed from ``g`` before the
    state is put back), so the next epoch's order differs; the README's (and LoaderDigitsSpec's)
    sampler with a generator of its own gives a run that never stopped. Without Prefect."""
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    data = TensorDataset(torch.arange(22))

    def loader():  # type: ignore[no-untyped-def]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            if shuffle == "shuffle=True":
                return StatefulDataLoader(
                    data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
                )
            sampler = RandomSampler(data, generator=torch.Generator().manual_seed(7))
            return StatefulDataLoader(
                data, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(8)
            )

    straight = epochs_of(loader(), 2)
    paused = loader()
    batches = iter(paused)
    first = [int(i) for _ in range(2) for i in next(batches)[0]]
    state = copy.deepcopy(paused.state_dict())
    resumed = loader()
    resumed.load_state_dict(state)
    rest, later = epochs_of(resumed, 2)
    assert first + rest == straight[0]  # the resumed epoch: right either way
    assert (later == straight[1]) is (shuffle == "own sampler"), (later, straight[1])
