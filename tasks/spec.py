"""The protocol between ckptflow and the user's training code.

A user subclasses :class:`TrainingSpec` (``from ckptflow.tasks.spec import
TrainingSpec``), names the subclass by import path,
``"package.module:ClassName"``, and ckptflow builds it from a JSON config and a
seed. The spec builds the model and optimizer (and optionally an LR scheduler
and a grad scaler), trains one epoch and returns metrics, and may evaluate.
Everything the pipeline saves comes from the objects the spec builds, plus the
spec's own ``state_dict`` for anything else (a data-loader position, say).

The spec also learns facts of the run it trains in (:class:`RunFacts`, as
``self.run``, set before ``build``): the epoch the run trains until, the epochs
it was started for, the save cadence, the number of ranks and its own rank,
the store's URL. They are not part of the run's identity: training longer
resumes the same run. A schedule is sized from ``planned_epochs``, which every
checkpoint records and every resume keeps: a scheduler's saved state is
restored over the one ``build`` made, so the schedule ``build`` makes must be
the one that state belongs to, whatever ``--epochs`` a resume is given.

The contract (the README's "Your own model" shows it whole): a checkpoint
holds the Trainable's objects (their ``state_dict``), ``Trainable.extras``
(objects with ``state_dict``, and ``torch.Generator`` objects), the spec's own
``state_dict``, the global RNGs (torch, CUDA, numpy, Python) and the epoch and
step; nothing else. For a resumed run to be bitwise identical to an
uninterrupted one, an epoch must depend only on that state and the epoch
number: every generator the spec keeps (a DataLoader's) goes in ``extras``, or
is made afresh each epoch from ``(seed, epoch)`` (see :func:`epoch_generator`);
other randomness comes from the global RNGs.

Checkpoints inside epochs: a spec that implements :meth:`TrainingSpec.train_steps`
(a generator that yields after each optimizer step) instead of ``train_epoch``
can be saved, and resumed, between any two steps: ``save_every_steps``,
``save_every_minutes`` and a stop request (SIGTERM, a cancellation) pause it
there. Its position in the epoch is part of the checkpoint; the spec's share
of it is to skip the ``start`` steps already trained (a plain DataLoader: the
epoch's order from :func:`epoch_generator`, sliced; a torchdata
``StatefulDataLoader`` in ``Trainable.extras`` resumes by itself) and to keep
what it accumulates over the epoch (a loss sum) in its own ``state_dict``.
A spec that overrides ``train_epoch`` trains whole epochs: step and minute
cadences then save at the end of the epoch in which they fall due.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RunFacts:
    """What a spec knows of the run it trains in; none of it is part of the run's identity."""

    epochs: int = 1  # the epoch the run trains until (its target, counted from 1, not the epochs left)
    planned_epochs: int = 1  # the target the run was started with, kept by every resume: size schedules by it
    save_every: int = 1  # a checkpoint every N epochs (and at the end)
    save_every_steps: int | None = None  # ... and every N optimizer steps (train_steps specs: inside epochs)
    save_every_minutes: float | None = None  # ... and every M minutes of training
    world_size: int = 1  # training processes (torch.distributed ranks)
    rank: int = 0  # this process's rank
    storage: str = ""  # the store's URL, without credentials


@dataclass
class Trainable:
    """What a spec builds: the objects whose state a checkpoint holds."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None  # anything with state_dict()/load_state_dict(), e.g. an LRScheduler
    scaler: Any = None  # e.g. torch.amp.GradScaler
    extras: dict[str, Any] = field(default_factory=dict)  # more: objects with state_dict(), torch.Generators


class TrainingSpec(ABC):
    """Subclass this and pass ``"your.module:YourSpec"`` as the pipeline's ``spec``."""

    run: RunFacts = RunFacts()  # the run's facts: ckptflow sets them before build() (see make_spec)

    def __init__(self, config: Mapping[str, Any], *, seed: int) -> None:
        self.config = dict(config)
        self.seed = seed

    @abstractmethod
    def build(self) -> Trainable:
        """Create the model, optimizer, scheduler and data (called once per run)."""

    def train_epoch(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        """Train one epoch (epochs count from 1) and return its metrics.

        Implement this or :meth:`train_steps`; by default it runs ``train_steps`` through.
        """
        if type(self).train_steps is TrainingSpec.train_steps:
            raise NotImplementedError(f"{type(self).__name__} implements neither train_epoch nor train_steps")
        steps, count = self.train_steps(trainable, epoch, 0), 0
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return {"steps": count, **(end.value or {})}
            count += 1

    def train_steps(self, trainable: Trainable, epoch: int, start: int) -> Iterator[object]:
        """Train ``epoch`` from its step ``start`` (the steps already trained: 0 for a new epoch,
        more when a run resumes inside it), yielding after each optimizer step; ``return`` the
        epoch's metrics. The run may be saved at any yield, and resumed there by a new call with
        ``start`` = the steps trained: skip them, and keep what the epoch accumulates in
        :meth:`state_dict`. What is yielded is not used. Optional: see the module's docstring."""
        raise NotImplementedError

    def steps_per_epoch(self, epoch: int) -> int | None:
        """How many steps ``epoch`` has, if the spec knows (progress reads "step 1,200/4,000", and a
        step save due at the epoch's last step is made at its end instead); None: unknown."""
        return None

    def evaluate(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        """Optional evaluation after an epoch; its metrics join the epoch's."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Extra state of the spec itself to checkpoint (JSON values or tensors)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        return None


def trains_by_steps(spec: TrainingSpec | type[TrainingSpec]) -> bool:
    """Whether a spec trains step by step (implements ``train_steps``, not ``train_epoch``)."""
    kind = spec if isinstance(spec, type) else type(spec)
    return kind.train_steps is not TrainingSpec.train_steps and kind.train_epoch is TrainingSpec.train_epoch


class SpecError(ValueError):
    """The ``spec`` import path does not name a usable TrainingSpec."""


def load_spec_class(path: str) -> type[TrainingSpec]:
    """Import ``"package.module:ClassName"`` and check that it is a TrainingSpec."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"spec {path!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"cannot import the module of spec {path!r}: {exc}") from exc
    except Exception as exc:  # the module itself failed: say so in one line, the traceback is chained
        raise SpecError(f"importing the module of spec {path!r} failed: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise SpecError(f"module {module_name!r} has no attribute {attr!r} (spec {path!r})")
    if not (isinstance(obj, type) and issubclass(obj, TrainingSpec)):
        raise SpecError(f"spec {path!r} is not a subclass of ckptflow.tasks.spec.TrainingSpec")
    if obj.train_epoch is TrainingSpec.train_epoch and obj.train_steps is TrainingSpec.train_steps:
        raise SpecError(f"spec {path!r} implements neither train_epoch nor train_steps: implement one")
    return obj


def make_spec(path: str, config: Mapping[str, Any], *, seed: int, run: RunFacts) -> TrainingSpec:
    """The spec of a run: imported, constructed from its config and seed, told the run's facts."""
    spec = load_spec_class(path)(config, seed=seed)
    spec.run = run
    return spec


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A torch generator that depends only on the run's seed and the epoch."""
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)
