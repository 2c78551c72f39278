"""The README's complete spec ("Your own model") runs as written: it resumes, and trains longer,
bit for bit; a spec that keeps a generator out of its checkpoint is warned about.

Bugs fixed:

- The README sized OneCycleLR from ``self.run.epochs``, and the hint printed at
  the end of ``ckptflow run`` (``--epochs N`` on the finished run) then failed
  with ``ValueError: Tried to step 97 times``: the restored schedule keeps the
  length it was built with. A spec now sizes a schedule from
  ``RunFacts.planned_epochs``, which every checkpoint records and every resume
  keeps, and holds its final LR past it.
- What a spec must hand the checkpoint (every ``torch.Generator`` it keeps, a
  DataLoader's included) was written in docstrings only, and a spec that left
  its loader's generator out resumed without a warning, shuffling differently
  from the run that never stopped.

The test takes the README's code block as it is, writes it as a module, and
runs it through the pipeline in the flow's process and in trainers.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ckptflow.storage import CheckpointStore
from ckptflow.tasks.config import PipelineConfig
from ckptflow.tasks.spec import Trainable, TrainingSpec, epoch_generator
from ckptflow.tasks.training.run_state import EpochAttempts, build_run, capture_run, open_store, train_attempt
from tests.pipeline.helpers import (
    REPO,
    assert_same_checkpoint,
    assert_same_metrics,
    make_config,
    poll,
    run_logs,
    run_summary,
)

pytestmark = pytest.mark.prefect

README = REPO / "README.md"
MARKER = "<!-- tests/pipeline/test_readme_spec.py runs the next code block as written -->"
MODULE = "readme_spec"
SPEC = f"{MODULE}:MySpec"
FORGETFUL_SPEC = f"{MODULE}:ForgetfulSpec"
MODES = pytest.mark.parametrize("trainers", [False, True], ids=["in-process", "trainers"])

# Test code only, after the README's: the README's spec with its loader's generator left out.
FORGETFUL = """

class ForgetfulSpec(MySpec):
    def build(self) -> Trainable:
        trainable = super().build()
        del trainable.extras["order"]
        return trainable
"""


def readme_code() -> str:
    """The python code block after the README's marker, as written."""
    text = README.read_text()
    assert MARKER in text, "the README lost the marker of its tested spec example"
    after = text.split(MARKER, 1)[1].lstrip()
    assert after.startswith("```python\n"), "the README's marker is not followed by a python block"
    return after[len("```python\n") :].split("\n```", 1)[0] + "\n"


@pytest.fixture(scope="module")
def spec_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The README's spec as module ``readme_spec``, importable here and in training processes."""
    directory = tmp_path_factory.mktemp("readme-spec")
    (directory / f"{MODULE}.py").write_text(readme_code() + FORGETFUL)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), before]))
    sys.path.insert(0, str(directory))
    try:
        yield directory
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop(MODULE, None)
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def config(storage: Path, epochs: int, trainers: bool, spec: str = SPEC) -> PipelineConfig:
    """A run of the README's spec (8 batches an epoch), in the flow's process or in trainers."""
    return make_config(
        storage, spec=spec, spec_config={"batch_size": 128}, epochs=epochs, train_process=trainers
    )


@MODES
def test_resumed_and_longer_runs_equal_the_straight_run(prefect_server, tmp_path, spec_module, trainers):
    """Bug fix: the README's OneCycleLR, sized from ``self.run.epochs``, failed on the hint's
    ``--epochs N`` with ``ValueError: Tried to step 97 times``. Straight: --epochs 3, then
    --epochs 5 (train longer). Resumed: --epochs 3 whose epoch 3 never committed, resumed with
    --epochs 5. Every version is the same, byte for byte, and the schedule holds its final LR."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_summary(config(straight, 3, trainers))
    longer, _ = run_summary(config(straight, 5, trainers))
    assert (longer["resumed_from"], longer["last_epoch"], longer["planned_epochs"]) == (3, 5, 3)

    run_summary(config(resumed, 3, trainers))
    shutil.rmtree(resumed / "v000003")  # as if the run had died before committing epoch 3
    assert CheckpointStore(str(resumed)).latest().version == 2
    summary, _ = run_summary(config(resumed, 5, trainers))
    assert (summary["resumed_from"], summary["last_epoch"], summary["planned_epochs"]) == (2, 5, 3)

    got, want = CheckpointStore(str(resumed)), CheckpointStore(str(straight))
    for version in range(1, 6):
        assert_same_checkpoint(got, want, version)
    assert_same_metrics(got, want)
    assert [v.user["planned_epochs"] for v in got.versions()] == [3] * 5  # kept by every resume
    state = [want.load(v) for v in (3, 4, 5)]
    assert set(state[0]["extras"]) == {"ema", "order"}
    schedule = [s["scheduler"] for s in state]
    assert schedule[0]["last_epoch"] == schedule[0]["total_steps"] == schedule[2]["last_epoch"]
    final_lr = {s["optimizer"]["param_groups"][0]["lr"] for s in state}
    assert len(final_lr) == 1  # epochs 4 and 5 train at the schedule's final LR


@MODES
def test_a_generator_left_out_of_the_checkpoint_is_warned_about_once(
    prefect_server, tmp_path, spec_module, trainers
):
    """Bug fix: a spec that left its DataLoader's generator out of ``extras`` resumed without a
    warning, shuffling unlike the run that never stopped. Now the run's log says which generator
    the checkpoint will not restore and what to do, once (not at every save); the README's spec
    itself gets no such warning."""
    _, run_id = run_summary(config(tmp_path / "forgetful", 3, trainers, spec=FORGETFUL_SPEC))
    lines = [x for x in ended_logs(run_id) if "torch.Generator" in x]
    assert len(lines) == 1, lines
    assert "self.order (also self.loader.generator, self.loader.sampler.generator)" in lines[0], lines[0]
    assert "Trainable.extras" in lines[0], lines[0]  # what to do

    _, run_id = run_summary(config(tmp_path / "kept", 2, trainers))
    assert not [x for x in ended_logs(run_id) if "torch.Generator" in x]


def ended_logs(run_id) -> list[str]:
    """A finished run's log, once its last line ("stopped: ...") has reached the API."""
    logs = poll(lambda: run_logs(run_id), lambda got: any(x.startswith("stopped:") for x in got))
    assert any(x.startswith("stopped:") for x in logs), logs
    return logs


class GeneratorSpec(TrainingSpec):
    """A tiny spec keeping a generator the way ``config["how"]`` says; it draws from it every epoch."""

    def build(self) -> Trainable:
        self.gen = torch.Generator().manual_seed(5)
        if self.config["how"] == "in a loader in a dict":
            data = TensorDataset(torch.arange(8.0))
            self.loaders = {"train": DataLoader(data, batch_size=4, shuffle=True, generator=self.gen)}
            del self.gen
        model = torch.nn.Linear(2, 1)
        extras = {"gen": self.gen} if self.config["how"] == "in extras" else {}
        return Trainable(model=model, extras=extras)

    def train_epoch(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        how = self.config["how"]
        if how == "seeded each epoch":
            self.gen.manual_seed(100 + epoch)
        if how == "made each epoch":
            self.gen = epoch_generator(self.seed, epoch)
        if how == "in a loader in a dict":
            return {"steps": len(list(self.loaders["train"]))}
        torch.randn(3, generator=self.gen)
        return {"steps": 1}

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self.gen.get_state()} if self.config["how"] == "in the spec's state" else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "gen" in state:
            self.gen.set_state(state["gen"])


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("kept", "self.gen"),
        (
            "in a loader in a dict",
            "self.loaders['train'].generator (also self.loaders['train'].sampler.generator)",
        ),
        ("in extras", None),
        ("in the spec's state", None),
        ("seeded each epoch", None),
        ("made each epoch", None),
    ],
)
def test_which_generators_are_named(tmp_path, how, named):
    """The warning for generators a resume would not restore (a spec's own, a loader's in a dict)
    names only those: not a generator in ``extras`` or in the spec's state, nor one seeded or made
    each epoch, which a warning there would wrongly call a bug. Without Prefect."""
    config = PipelineConfig(
        storage=str(tmp_path / "store"), spec=f"{__name__}:GeneratorSpec", spec_config={"how": how}
    )
    run = build_run(config, open_store(config), info=lambda _: None, warn=lambda _: None)
    notes: list[str] = []
    for epoch in (1, 2):
        train_attempt(run, epoch, EpochAttempts(run, keep_snapshot=False), notes.append)
        capture_run(run, notes.append)
    if named is None:
        assert notes == []
    else:
        assert len(notes) == 1 and f"do not restore: {named}." in notes[0], notes
