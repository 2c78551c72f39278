"""The pipeline with a model whose state is sharded: FSDP2 (the demo LM, ``fully_shard`` per block),
gloo on 127.0.0.1, against a real Prefect server.

Every rank writes its shards of each checkpoint; a run resumed at the same number of ranks ends
bit for bit where a straight run ends, and a store goes from 2 ranks to 3 to 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptflow.storage import CheckpointStore
from tests.conftest import assert_same_state
from tests.pipeline.helpers import make_config, run_counts, run_summary

pytestmark = [pytest.mark.prefect, pytest.mark.timeout(600)]

SPEC = "ckptflow.flows.demo_lm:TinyLMSpec"


def config(storage: Path, **fields: Any) -> Any:
    return make_config(storage, spec=SPEC, spec_config={"sequences": 96, "batch_size": 16}, **fields)


def test_a_resumed_sharded_run_equals_a_straight_one(prefect_server, tmp_path: Path) -> None:
    straight, run_id = run_summary(config(tmp_path / "A", epochs=4, nproc=2))
    assert straight["last_epoch"] == 4
    assert run_counts(run_id, "train_epoch", 4) == [1] * 4, "one train_epoch task run per epoch"
    want = CheckpointStore(tmp_path / "A")
    manifest = want.manifest(4)
    assert manifest.chunked and manifest.world_size == 2 and {s.rank for s in manifest.shards} == {0, 1}

    first, _ = run_summary(config(tmp_path / "B", epochs=2, nproc=2))
    assert first["last_epoch"] == 2
    resumed, _ = run_summary(config(tmp_path / "B", epochs=4, nproc=2))
    assert resumed["resumed_from"] == 2 and resumed["last_epoch"] == 4
    got = CheckpointStore(tmp_path / "B")
    for version in (3, 4):
        assert got.info(version).metrics == want.info(version).metrics
        assert_same_state(got.load(version), want.load(version))
        for rank in (0, 1):
            assert_same_state(
                got.load_rank_state(version, rank=rank, world_size=2),
                want.load_rank_state(version, rank=rank, world_size=2),
                f"rank {rank}",
            )


def test_a_sharded_store_goes_from_2_ranks_to_3_to_1(prefect_server, tmp_path: Path) -> None:
    storage = tmp_path / "S"
    run_summary(config(storage, epochs=2, nproc=2))
    three, _ = run_summary(config(storage, epochs=3, nproc=3))
    assert three["resumed_from"] == 2 and three["last_epoch"] == 3
    one, _ = run_summary(config(storage, epochs=4, nproc=1, train_process=True))
    assert one["resumed_from"] == 3 and one["last_epoch"] == 4
    store = CheckpointStore(storage)
    assert [store.manifest(v).world_size for v in (1, 2, 3, 4)] == [2, 2, 3, 1]
    losses = [store.info(v).metrics["loss"] for v in (1, 2, 3, 4)]
    assert losses[-1] < losses[0], f"training went on across the changes: {losses}"
    state = store.load(4)
    assert state["progress"]["epoch"] == 4 and "embed.weight" in state["model"]
