"""Resume equivalence: a run SIGKILLed mid-training and resumed ends bit for bit where a straight run ends.

Run A trains 6 epochs straight. Run B, same config on another store, runs in a
child process that is SIGKILLed while epoch 4 trains (the spec announces the
epoch with a marker file and then sleeps, so the kill lands inside it); the
store then holds only committed versions; B is started again and goes on to
epoch 6 from the newest committed one. Every tensor of the final state
(model, optimizer, scheduler, torch and NumPy RNG states, progress) and every
epoch's metrics must be the same in A and B. Python's global ``random`` is shared
with Prefect's threads (see ``assert_same_checkpoint``); that its state is saved
and restored exactly is checked without Prefect, by the last test.
"""

from __future__ import annotations

import pytest

from ckptflow.storage import CheckpointStore
from tests.pipeline.helpers import (
    assert_only_committed,
    assert_same_checkpoint,
    assert_same_metrics,
    make_config,
    run_summary,
    start_slowed,
)
from tests.pipeline.specs import marker

pytestmark = pytest.mark.prefect

EPOCHS = 6
KILLED_IN = 4


@pytest.mark.crash
@pytest.mark.parametrize("async_save", [True, False], ids=["async-save", "sync-save"])
def test_killed_and_resumed_run_equals_straight_run(prefect_server, tmp_path, async_save):
    a = make_config(tmp_path / "A", epochs=EPOCHS, async_save=async_save)
    b = make_config(tmp_path / "B", epochs=EPOCHS, async_save=async_save)
    assert a.identity() == b.identity()

    straight, _ = run_summary(a)
    assert straight["last_epoch"] == EPOCHS and straight["resumed_from"] is None

    child, markers = start_slowed(prefect_server, b, tmp_path, KILLED_IN, 120)
    child.kill()
    assert child.proc.returncode == -9
    assert not marker(markers, KILLED_IN + 1).exists()

    # Only committed versions are listed, each one loads; epochs 1..2 were committed before
    # epoch 4 began (3 as well when the save is synchronous; an async save of 3 may be cut off).
    committed = assert_only_committed(b.storage, garbage_allowed=async_save)
    expected = list(range(1, KILLED_IN))
    allowed = [expected, expected[:-1]] if async_save else [expected]
    assert committed in allowed, f"committed {committed} after the kill"
    newest = CheckpointStore(b.storage).latest()
    assert newest is not None and newest.version == committed[-1]

    resumed, _ = run_summary(b)
    assert resumed["resumed_from"] == committed[-1]
    assert resumed["first_epoch"] == committed[-1] + 1
    assert resumed["last_epoch"] == EPOCHS

    store_a, store_b = CheckpointStore(a.storage), CheckpointStore(b.storage)
    assert assert_only_committed(b.storage) == list(range(1, EPOCHS + 1))
    for version in range(1, EPOCHS + 1):
        assert_same_checkpoint(store_b, store_a, version)
    assert_same_metrics(store_b, store_a)


def test_rng_draws_between_epochs_do_not_reach_the_training_state(prefect_server, tmp_path):
    """Bug fix: the RNG states saved were whatever the process's global RNGs held at save time.

    Anything drawing from them between epochs (Prefect's retry jitter draws from ``random``)
    changed the saved state, so a retried or resumed run was not bitwise equal to a straight
    one. The pipeline now carries the training RNG states from one epoch to the next itself.
    """
    import random

    import numpy as np
    import torch

    from ckptflow.tasks.reporting.monitoring import add_listener

    clean = make_config(tmp_path / "clean", epochs=3)
    noisy = make_config(tmp_path / "noisy", epochs=3)
    run_summary(clean)

    def draw(kind: str, data: dict) -> None:
        if kind == "epoch":  # between two epochs, in the flow's thread, as a retry's jitter would
            random.random()
            np.random.rand()
            torch.rand(1)

    remove = add_listener(draw)
    try:
        run_summary(noisy)
    finally:
        remove()
    for v in (1, 2, 3):
        assert_same_checkpoint(CheckpointStore(noisy.storage), CheckpointStore(clean.storage), v)


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    """capture() -> store -> restore() puts back torch's, NumPy's and Python's RNG states exactly."""
    import copy
    import random

    import numpy as np
    import torch

    from ckptflow.flows.demo import DigitsSpec
    from ckptflow.tasks.training.training_state import capture, restore, rng_state
    from tests.conftest import assert_same_state

    spec = DigitsSpec({"hidden": 8}, seed=3)
    trainable = spec.build()
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    random.random(), np.random.rand(), torch.rand(3)  # states somewhere in their streams
    state = capture(trainable, spec, epoch=1, step=7)
    saved = copy.deepcopy(state["rng"])
    store = CheckpointStore(tmp_path / "s")
    store.save(state, epoch=1, version=1)
    expected = (float(np.random.rand()), torch.rand(3))
    loaded = store.load(1)
    assert_same_state(loaded["rng"], saved)

    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    assert restore(trainable, spec, loaded) == (1, 7, 0)
    # Compared at once: in a process with a Prefect client, another thread may draw from `random`.
    assert_same_state(rng_state(), saved)
    assert float(np.random.rand()) == expected[0]
    assert torch.equal(torch.rand(3), expected[1])
