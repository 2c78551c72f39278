"""A run's store takes no other writer's versions, and a run never takes another writer's version
for its own.

Bug fixed: a spec that saved into the run's store from inside an epoch
(``CheckpointStore(self.run.storage).save(...)``) was not stopped by the run's
writer lease; the pipeline then adopted that version under its own number,
reported "committed v000002" with the size of the user's partial save, and the
damage showed only at resume (``KeyError: 'ema'`` after three init attempts).
Now the spec's save is refused while the run holds the lease, naming the
holder, in the flow's own process and in a training process alike; and a run
refuses to resume from a version that lacks what every ckptflow save holds.

Bug fixed: that refusal also took a version that lacked only a part the spec
gained since (a scheduler, a scaler, a generator put in ``Trainable.extras`` as
the run's own warning advises) for another writer's, and told the user to
delete a good checkpoint. Such parts now start fresh, with a warning naming them.
"""

from __future__ import annotations

import os

import pytest
import torch

from ckptflow.flows.demo import DigitsSpec
from ckptflow.storage import CheckpointStore
from ckptflow.tasks.spec import Trainable
from tests.pipeline.helpers import assert_only_committed, make_config, poll, run_flow, run_logs, run_summary
from tests.pipeline.specs import SELF_SAVING_SPEC

pytestmark = pytest.mark.prefect

GROWING_SPEC = "tests.pipeline.test_foreign_writers:GrowingDigitsSpec"
WITH_ORDER_ENV = "CKPTFLOW_TEST_WITH_ORDER"


class GrowingDigitsSpec(DigitsSpec):
    """DigitsSpec that, with ``CKPTFLOW_TEST_WITH_ORDER`` set, also keeps a generator in extras:
    the code gained it, the run's identity did not."""

    def build(self) -> Trainable:
        trainable = super().build()
        if os.environ.get(WITH_ORDER_ENV):
            trainable.extras["order"] = torch.Generator().manual_seed(self.seed + 1)
        return trainable


@pytest.mark.parametrize("train_process", [False, True], ids=["in-process", "trainer"])
def test_a_spec_saving_into_the_runs_store_is_refused(prefect_server, tmp_path, train_process):
    config = make_config(tmp_path / "store", epochs=3, spec=SELF_SAVING_SPEC, train_process=train_process)
    state, _ = run_flow(config)
    assert state.is_failed(), state
    message = state.message
    assert "writer lease" in message and "ckptflow run (flow run" in message, message
    assert "a spec does not save to the run's store itself" in message, message
    store = CheckpointStore(config.storage)
    assert assert_only_committed(config.storage, garbage_allowed=True) == [1]  # the run's own save alone
    assert set(store.load(1)) >= {"model", "optimizer", "rng", "progress"}


def test_a_run_does_not_resume_from_a_version_its_spec_did_not_save(prefect_server, tmp_path):
    """A library save into a run's store between runs is the newest version: the run names it and
    says what it lacks, instead of failing deep in the restore (KeyError) after retries."""
    config = make_config(tmp_path / "store", epochs=2)
    run_summary(config)
    store = CheckpointStore(config.storage)
    model = store.load(2)["model"]
    assert store.save({"model": model}, epoch=3).version == 3  # no lease held: a plain save
    state, _ = run_flow(make_config(tmp_path / "store", epochs=4))
    assert state.is_failed(), state
    message = state.message
    assert "version 3 of" in message and "does not hold what this run saves" in message, message
    assert "optimizer" in message and "rng" in message, message
    assert len(message) < 800, message
    assert [v.version for v in store.versions()] == [1, 2, 3]
    assert torch.equal(store.load(3)["model"]["0.weight"], model["0.weight"])


def test_a_part_the_spec_gained_since_the_save_starts_fresh(prefect_server, tmp_path, monkeypatch):
    """Bug: a version saved before the spec put a generator in ``Trainable.extras`` (as the run's
    own warning advises) was refused as "not saved by a ckptflow run", and the user told to
    delete it. Now the run resumes from it; the new part starts fresh, with a warning naming it."""
    config = make_config(tmp_path / "store", epochs=2, spec=GROWING_SPEC)
    run_summary(config)
    store = CheckpointStore(config.storage)
    assert "extras" not in store.load(2)
    monkeypatch.setenv(WITH_ORDER_ENV, "1")
    summary, run_id = run_summary(make_config(tmp_path / "store", epochs=3, spec=GROWING_SPEC))
    assert summary["resumed_from"] == 2 and summary["last_epoch"] == 3, summary
    wanted = "version 2 holds no saved state for extras.order"
    messages = poll(lambda: run_logs(run_id), lambda logs: any(wanted in m for m in logs))
    [line] = [m for m in messages if wanted in m]
    assert line == f"{wanted} (added to the spec since it was saved?): it starts fresh, as build() made it"
    assert not any("not saved by a ckptflow run" in m for m in messages), messages
    assert [v.version for v in store.versions()] == [1, 2, 3]
    assert set(store.load(3)["extras"]) == {"order"}
