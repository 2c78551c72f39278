"""The pipeline with a model whose state is sharded: FSDP2 (the demo LM, ``fully_shard`` per block),
gloo on 127.0.0.1, against a real Prefect server.

Every rank writes its shards of each checkpoint; a run resumed at the same number of ranks ends
bit for bit where a straight run ends, and the resumed store then goes from 2 ranks to 3 to 1.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptflow.storage import CheckpointStore
from tests.conftest import assert_same_state
from tests.pipeline.helpers import make_config, poll, run_counts, run_flow, run_summary, task_runs

pytestmark = [pytest.mark.prefect, pytest.mark.timeout(600)]

SPEC = "ckptflow.flows.demo_lm:TinyLMSpec"
EPOCHS = 3


def config(storage: Path, **fields: Any) -> Any:
    return make_config(storage, spec=SPEC, spec_config={"sequences": 96, "batch_size": 16}, **fields)


@pytest.fixture(scope="module")
def resumed(prefect_server, tmp_path_factory) -> Path:
    """A W=2 run of 2 epochs, resumed at W=2 to epoch 3."""
    storage = tmp_path_factory.mktemp("sharded") / "B"
    first, _ = run_summary(config(storage, epochs=2, nproc=2))
    assert first["last_epoch"] == 2
    again, _ = run_summary(config(storage, epochs=EPOCHS, nproc=2))
    assert again["resumed_from"] == 2 and again["last_epoch"] == EPOCHS
    return storage


def test_a_resumed_sharded_run_equals_a_straight_one(prefect_server, resumed: Path, tmp_path: Path) -> None:
    straight, run_id = run_summary(config(tmp_path / "A", epochs=EPOCHS, nproc=2))
    assert straight["last_epoch"] == EPOCHS
    assert run_counts(run_id, "train_epoch", EPOCHS) == [1] * EPOCHS, "one train_epoch task run per epoch"
    want = CheckpointStore(tmp_path / "A")
    manifest = want.manifest(EPOCHS)
    assert manifest.chunked and manifest.world_size == 2 and {s.rank for s in manifest.shards} == {0, 1}
    got = CheckpointStore(resumed)
    assert got.info(EPOCHS).metrics == want.info(EPOCHS).metrics
    assert_same_state(got.load(EPOCHS), want.load(EPOCHS))
    for rank in (0, 1):
        assert_same_state(
            got.load_rank_state(EPOCHS, rank=rank, world_size=2),
            want.load_rank_state(EPOCHS, rank=rank, world_size=2),
            f"rank {rank}",
        )


def test_a_sharded_store_goes_from_2_ranks_to_3_to_1(prefect_server, resumed: Path, tmp_path: Path) -> None:
    storage = tmp_path / "S"
    shutil.copytree(resumed, storage)
    three, _ = run_summary(config(storage, epochs=EPOCHS + 1, nproc=3))
    assert three["resumed_from"] == EPOCHS and three["last_epoch"] == EPOCHS + 1
    one, _ = run_summary(config(storage, epochs=EPOCHS + 2, nproc=1, train_process=True))
    assert one["resumed_from"] == EPOCHS + 1 and one["last_epoch"] == EPOCHS + 2
    store = CheckpointStore(storage)
    assert [store.manifest(v).world_size for v in range(1, EPOCHS + 3)] == [2] * EPOCHS + [3, 1]
    losses = [store.info(v).metrics["loss"] for v in range(1, EPOCHS + 3)]
    assert losses[-1] < losses[0], f"training went on across the changes: {losses}"
    state = store.load(EPOCHS + 2)
    assert state["progress"]["epoch"] == EPOCHS + 2 and "embed.weight" in state["model"]


def test_a_model_that_no_longer_fits_is_refused_once_and_names_the_tensor(
    prefect_server, resumed: Path, tmp_path: Path
) -> None:
    """Resuming (with --allow-config-change) a model built wider than the one saved: the run fails
    on init, once (retrying cannot help), naming the tensor and both shapes; nothing committed is
    touched."""
    storage = tmp_path / "W"
    shutil.copytree(resumed, storage)
    wider = config(storage, epochs=EPOCHS + 1, nproc=2, allow_config_change=True)
    wider.spec_config["width"] = 48
    state, run_id = run_flow(wider)
    assert state.is_failed()
    message = str(state.message) + str(state.result(raise_on_failure=False))
    assert "does not fit the state to fill" in message and "[64, 32] in it and [64, 48]" in message, message
    runs = poll(lambda: task_runs(run_id), lambda rs: rs and all(t.state.is_final() for t in rs))
    assert [t.run_count for t in runs if t.name.startswith("init_model")] == [1]
    store = CheckpointStore(storage)
    assert [v.version for v in store.versions()] == list(range(1, EPOCHS + 1))
    store.verify(EPOCHS)
