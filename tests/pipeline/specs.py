"""Training specs for the pipeline tests: the demo's DigitsSpec, made observable or faulty.

Everything that changes their behaviour comes from the environment or from a
class attribute, never from ``spec_config``: ``spec_config`` is part of the run
identity, so a slowed-down or failing run and a clean reference run must share it.

- :class:`MarkedDigitsSpec`: when ``CKPTFLOW_TEST_MARKERS`` names a directory,
  writes ``epoch-<n>-started`` there (its content: the flow run id) at the start
  of every epoch, and sleeps ``CKPTFLOW_TEST_SLOW_SECONDS`` in epochs >=
  ``CKPTFLOW_TEST_SLOW_FROM``: a test can see an epoch begin and kill or cancel
  the run while it lasts. With ``CKPTFLOW_TEST_SLOW_SAVE`` = ``<version>:<seconds>``,
  each rank's first write of that version's shards first sleeps that long (once
  per rank and marker directory: trainers started again write at full speed), so
  a test can kill the trainers while an async save is in flight.
- :class:`FlakyDigitsSpec`: fails the first attempts of chosen epochs *after*
  training them fully (model, optimizer, scheduler and RNGs all moved on), so
  a retry that did not restore the epoch's start state would end elsewhere.
- :class:`RepeatingFailureSpec`: epoch ``CKPTFLOW_TEST_FAIL_EPOCH`` fails the
  same way at every attempt, as a deterministic bug does.
- ``CKPTFLOW_TEST_EXTRA_HIDDEN``: :class:`MarkedDigitsSpec` builds a wider
  hidden layer than its ``spec_config`` says: a model changed in the code.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import ClassVar

from ckptflow.flows.demo import DigitsSpec
from ckptflow.tasks.spec import Trainable

MARKERS_ENV = "CKPTFLOW_TEST_MARKERS"
SLOW_FROM_ENV = "CKPTFLOW_TEST_SLOW_FROM"
SLOW_SECONDS_ENV = "CKPTFLOW_TEST_SLOW_SECONDS"
SLOW_SAVE_ENV = "CKPTFLOW_TEST_SLOW_SAVE"

MARKED_SPEC = "tests.pipeline.specs:MarkedDigitsSpec"
FLAKY_SPEC = "tests.pipeline.specs:FlakyDigitsSpec"
FAULTY_SPEC = "tests.pipeline.specs:FaultyDigitsSpec"
FAULTS_ENV = "CKPTFLOW_TEST_FAULTS"
REPEATING_SPEC = "tests.pipeline.specs:RepeatingFailureSpec"
FAIL_EPOCH_ENV = "CKPTFLOW_TEST_FAIL_EPOCH"
EXTRA_HIDDEN_ENV = "CKPTFLOW_TEST_EXTRA_HIDDEN"
STEPPED_SPEC = "tests.pipeline.specs:SteppedDigitsSpec"
STEP_SECONDS_ENV = "CKPTFLOW_TEST_STEP_SECONDS"  # SteppedDigitsSpec: each step of slow epochs sleeps so long
MODULES_ENV = "CKPTFLOW_TEST_MODULES"  # MarkedDigitsSpec: a directory; each epoch lists the modules loaded
EVALUATING_ENV = "CKPTFLOW_TEST_EVALUATING"  # SteppedDigitsSpec: a directory; evaluate marks it, sleeps 3 s

# Small and fast: an epoch of the digits MLP takes a few tens of milliseconds.
SPEC_CONFIG = {"hidden": 32, "batch_size": 128}


def marker(directory: Path, epoch: int) -> Path:
    return directory / f"epoch-{epoch}-started"


class MarkedDigitsSpec(DigitsSpec):
    """DigitsSpec that announces each epoch in a marker directory and may slow down."""

    def build(self) -> Trainable:
        extra = int(os.environ.get(EXTRA_HIDDEN_ENV, "0"))
        if extra:  # the code changed, the run's identity did not
            self.config["hidden"] = int(self.config.get("hidden", 128)) + extra
        return super().build()

    def train_epoch(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        directory = os.environ.get(MARKERS_ENV)
        if directory:
            _slow_save_once(Path(directory))
            done = marker(Path(directory), epoch)  # whole or absent: a test reads it once it exists
            partial = done.with_name(f".{done.name}.{os.getpid()}.part")  # each rank its own
            partial.write_text(_flow_run_id())
            partial.replace(done)
            if epoch >= int(os.environ.get(SLOW_FROM_ENV, "1")):
                time.sleep(float(os.environ.get(SLOW_SECONDS_ENV, "0")))
        loaded = os.environ.get(MODULES_ENV)
        if loaded:  # what this training process has imported, by rank
            rank = os.environ.get("RANK", "solo")
            names = sorted(name for name in sys.modules if name.split(".")[0] in ("prefect", "ckptflow"))
            Path(loaded, f"modules-{rank}-epoch-{epoch}.txt").write_text("\n".join(names))
        return super().train_epoch(trainable, epoch)


def _slow_save_once(directory: Path) -> None:
    """Make this rank's first write of version V's shards sleep first (``CKPTFLOW_TEST_SLOW_SAVE``)."""
    from ckptflow.storage.save import writer

    wanted = os.environ.get(SLOW_SAVE_ENV)
    if not wanted or getattr(writer, "_slowed_for_test", False):
        return
    version, seconds = wanted.split(":")
    rank = os.environ.get("RANK", "0")
    original = writer._write_shard

    def write_shard(loc, version_dir, *rest):  # type: ignore[no-untyped-def]
        done = directory / f"save-{version}-slowed-r{rank}"
        if version_dir == f"v{int(version):06d}" and not done.exists():
            done.touch()
            time.sleep(float(seconds))
        return original(loc, version_dir, *rest)

    writer._write_shard = write_shard  # type: ignore[assignment]
    writer._slowed_for_test = True  # type: ignore[attr-defined]


def _flow_run_id() -> str:
    """The flow run's id; a training rank reads it from its environment, without importing Prefect.

    Importing Prefect draws from Python's ``random``: a rank that imported it only in a
    marked run would not be bitwise comparable with an unmarked one.
    """
    if "prefect" not in sys.modules:
        return os.environ.get("CKPTFLOW_FLOW_RUN_ID", "")
    from prefect.runtime import flow_run

    return str(flow_run.get_id() or "")


class EpochFailure(RuntimeError):
    """The planned failure of a FlakyDigitsSpec epoch."""


class FlakyDigitsSpec(DigitsSpec):
    """DigitsSpec whose epochs fail ``failures[epoch]`` times, each after training the whole epoch."""

    failures: ClassVar[dict[int, int]] = {}  # epoch -> failing attempts left (set by the test)
    attempts: ClassVar[dict[int, int]] = {}  # epoch -> attempts seen

    def train_epoch(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        type(self).attempts[epoch] = type(self).attempts.get(epoch, 0) + 1
        metrics = super().train_epoch(trainable, epoch)  # moves every piece of state on
        left = type(self).failures.get(epoch, 0)
        if left > 0:
            type(self).failures[epoch] = left - 1
            raise EpochFailure(f"planned failure of epoch {epoch} ({left - 1} more to come)")
        return metrics


class FaultyDigitsSpec(FlakyDigitsSpec):
    """FlakyDigitsSpec for a run whose model lives in a training process, out of the test's reach.

    ``CKPTFLOW_TEST_FAULTS`` plans the faults: ``"2:2"`` fails epoch 2 twice (after training
    it); ``"3:kill"`` SIGKILLs the process that trains, at the start of epoch 3 (every attempt),
    ``"3:killonce"`` only the first time (it leaves ``<markers>/killed-3``). Attempts are
    appended to ``<markers>/attempts`` as ``<epoch> <pid> <parent pid>`` lines.
    """

    failures: ClassVar[dict[int, int]] = {}
    attempts: ClassVar[dict[int, int]] = {}
    _planned: ClassVar[bool] = False

    def train_epoch(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        cls = type(self)
        if not cls._planned:
            cls._planned = True
            for item in filter(None, os.environ.get(FAULTS_ENV, "").split(",")):
                at, what = item.split(":")
                cls.failures[int(at)] = {"kill": -1, "killonce": -2}.get(what) or int(what)
        directory = os.environ.get(MARKERS_ENV)
        if directory:
            with open(Path(directory) / "attempts", "a") as log:
                log.write(f"{epoch} {os.getpid()} {os.getppid()}\n")
        if cls.failures.get(epoch) == -1:
            os.kill(os.getpid(), signal.SIGKILL)
        if cls.failures.get(epoch) == -2 and directory and not (Path(directory) / f"killed-{epoch}").exists():
            (Path(directory) / f"killed-{epoch}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().train_epoch(trainable, epoch)


SELF_SAVING_SPEC = "tests.pipeline.specs:SelfSavingDigitsSpec"


class SelfSavingDigitsSpec(DigitsSpec):
    """DigitsSpec that also saves its model into the run's own store in epoch 2, the natural way to
    try a mid-epoch save: ``CheckpointStore(self.run.storage).save(...)``."""

    def train_epoch(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        metrics = super().train_epoch(trainable, epoch)
        if epoch == 2:
            from ckptflow.storage import CheckpointStore

            CheckpointStore(self.run.storage).save({"model": trainable.model.state_dict()}, epoch=epoch)
        return metrics


class RepeatingFailureSpec(DigitsSpec):
    """DigitsSpec whose epoch ``CKPTFLOW_TEST_FAIL_EPOCH`` fails at every attempt, after training it,
    with the same error from the same line (as a schedule stepped past its end does). Each
    attempt appends its epoch to ``<markers>/attempts``, in any process."""

    def train_epoch(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        directory = os.environ.get(MARKERS_ENV)
        if directory:
            with open(Path(directory) / "attempts", "a") as log:
                log.write(f"{epoch}\n")
        metrics = super().train_epoch(trainable, epoch)
        if epoch == int(os.environ.get(FAIL_EPOCH_ENV, "0")):
            raise ValueError("Tried to step 97 times. The specified number of total steps is 96")
        return metrics


class SteppedDigitsSpec(DigitsSpec):
    """DigitsSpec (which trains by steps) whose steps sleep ``CKPTFLOW_TEST_STEP_SECONDS`` after each
    step of the epochs >= ``CKPTFLOW_TEST_SLOW_FROM``: a test can kill or stop a run between steps."""

    def train_steps(self, trainable, epoch, start):  # type: ignore[no-untyped-def]
        slow = epoch >= int(os.environ.get(SLOW_FROM_ENV, "1"))
        seconds = float(os.environ.get(STEP_SECONDS_ENV, "0")) if slow else 0.0
        steps = super().train_steps(trainable, epoch, start)
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value
            time.sleep(seconds)
            yield

    def evaluate(self, trainable, epoch):  # type: ignore[no-untyped-def]
        directory = os.environ.get(EVALUATING_ENV)
        if directory and epoch >= int(os.environ.get(SLOW_FROM_ENV, "1")):
            (Path(directory) / f"evaluating-{epoch}").touch()
            time.sleep(3)
        return super().evaluate(trainable, epoch)


LOADER_SPEC = "tests.pipeline.specs:LoaderDigitsSpec"
LOADER_LEFT_OUT_SPEC = "tests.pipeline.specs:LoaderLeftOutDigitsSpec"


class LoaderDigitsSpec(DigitsSpec):
    """DigitsSpec whose training data come from a torchdata ``StatefulDataLoader`` in
    ``Trainable.extras``: ``train_steps`` ignores ``start``, the restored loader resumes by itself.

    The order is shuffled by torchdata's own ``RandomSampler`` with a generator of its own, not by
    ``shuffle=True, generator=g``: that shares ``g`` between the sampler and the draw of the
    iterator's worker seed, a draw made *before* a restored state is put back, so a resumed loader
    ends the epoch with ``g`` one draw behind a loader that never stopped, and every later epoch's
    order differs (the rest of the resumed epoch is right). The loader's own generator, drawn
    from once per iterator, is a separate one (never the global RNG, which dropout draws from).
    """

    def build(self) -> Trainable:
        import warnings

        import torch
        from torch.utils.data import TensorDataset
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import RandomSampler

        trainable = super().build()
        data = TensorDataset(*self.train)
        order = torch.Generator().manual_seed(self.seed)
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            loader = StatefulDataLoader(
                data,
                batch_size=int(self.config.get("batch_size", 64)),
                sampler=RandomSampler(data, generator=order),
                generator=torch.Generator().manual_seed(self.seed + 1),
                num_workers=0,
            )
        trainable.extras["loader"] = loader
        # Not the loader itself: kept on self too, ckptflow's check of unsaved generators would name
        # its generators (it looks for their current states in the capture; the loader saves others).
        self.batches = len(loader)
        return trainable

    def loader(self, trainable: Trainable):  # type: ignore[no-untyped-def]
        return trainable.extras["loader"]

    def train_steps(self, trainable, epoch, start):  # type: ignore[no-untyped-def]
        """One step per batch of the loader, from where its state stands (``start`` only tells a
        new epoch, whose loss sums start at zero, from a resumed one)."""
        from torch import nn

        model, opt = trainable.model, trainable.optimizer
        model.train()
        if start == 0:
            self.sums = (0.0, 0)
        for x, y in self.loader(trainable):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            self.sums = (self.sums[0] + loss.item() * len(y), self.sums[1] + len(y))
            yield
        trainable.scheduler.step()
        return {"loss": self.sums[0] / self.sums[1]}

    def steps_per_epoch(self, epoch: int) -> int:
        return self.batches


class LoaderLeftOutDigitsSpec(LoaderDigitsSpec):
    """LoaderDigitsSpec that keeps its loader on ``self`` instead of in ``Trainable.extras``: its
    position is not saved, so a run resumed inside an epoch replays that epoch from its start."""

    def build(self) -> Trainable:
        trainable = super().build()
        self._kept = trainable.extras.pop("loader")
        return trainable

    def loader(self, trainable: Trainable):  # type: ignore[no-untyped-def]
        return self._kept


class FlakySteppedSpec(SteppedDigitsSpec):
    """SteppedDigitsSpec whose first attempt at step 7 of epoch 2 fails after training that step
    (the model, optimizer and RNGs moved on): a retry must start from where its stretch began."""

    failed: ClassVar[bool] = False

    def train_steps(self, trainable, epoch, start):  # type: ignore[no-untyped-def]
        steps = super().train_steps(trainable, epoch, start)
        done = start
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value
            done += 1
            if epoch == 2 and done == 7 and not FlakySteppedSpec.failed:
                FlakySteppedSpec.failed = True
                raise EpochFailure("step 7 of epoch 2 fails once")
            yield
