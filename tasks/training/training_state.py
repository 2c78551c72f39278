"""The full training state: what is saved, and how it is put back.

A checkpoint holds the model, optimizer, scheduler, grad scaler, extra objects
(anything with ``state_dict()``, and ``torch.Generator`` objects), the spec's
own state, the epoch and step, and the RNG states of torch (CPU and every CUDA
device), numpy and Python. Restoring all of it is what makes a resumed run
bitwise identical to one that never stopped; :func:`unsaved_generators` finds
the generators a spec keeps outside of it (a DataLoader's), which a resume
would not restore.

:class:`Snapshot` is an in-memory copy of that state, taken at the start of an
epoch so that a retried epoch starts from the same state, never from a
half-updated model.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..spec import Trainable, TrainingSpec, epoch_generator


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def rank_seed(seed: int, epoch: int, rank: int) -> int:
    """The RNG seed of a rank whose own state was not saved (the number of ranks changed)."""
    return (seed * 1_000_003 + epoch) * 1_009 + rank


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(tuple(state["numpy"]))
    random.setstate(_as_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def _as_tuples(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


def capture(
    trainable: Trainable,
    spec: TrainingSpec,
    *,
    epoch: int,
    step: int,
    in_epoch: int = 0,
    rng: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The state to checkpoint after ``epoch`` and ``in_epoch`` steps of the next one (references
    to live tensors, not copies).

    ``rng``: the RNG states to save (default: the process's current ones).
    """
    state: dict[str, Any] = {}
    if is_sharded(trainable.model):  # FSDP2 / DTensor: torch's own state dicts, keyed by name
        from torch.distributed.checkpoint.state_dict import get_state_dict

        optimizers: Any = trainable.optimizer if trainable.optimizer is not None else []
        state["model"], optimizer = get_state_dict(trainable.model, optimizers)
        if trainable.optimizer is not None:
            state["optimizer"] = optimizer
    else:
        state["model"] = trainable.model.state_dict()
        if trainable.optimizer is not None:
            state["optimizer"] = trainable.optimizer.state_dict()
    for name in ("scheduler", "scaler"):
        obj = getattr(trainable, name)
        if obj is not None:
            state[name] = obj.state_dict()
    if trainable.extras:
        state["extras"] = {k: _extra_state(v) for k, v in trainable.extras.items()}
    state["spec"] = spec.state_dict()
    state["rng"] = dict(rng) if rng is not None else rng_state()
    state["progress"] = {"epoch": epoch, "step": step, "in_epoch": in_epoch}
    return state


def restore(trainable: Trainable, spec: TrainingSpec, state: Mapping[str, Any]) -> tuple[int, int, int]:
    """Put a captured state back; return its (epoch, step, in_epoch): the last epoch completed,
    the optimizer steps, and the steps of the next epoch trained (0: the state of an epoch's end).

    An optimizer, scheduler, scaler or extras entry the state lacks is left as built."""
    if is_sharded(trainable.model) or _keyed_by_name(state.get("optimizer")):
        from torch.distributed.checkpoint.state_dict import set_state_dict  # names, DTensors: torch's own

        optimizers: Any = trainable.optimizer if trainable.optimizer is not None else []
        set_state_dict(
            trainable.model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optimizer", {}),
        )
    else:
        trainable.model.load_state_dict(state["model"])
        if trainable.optimizer is not None and "optimizer" in state:
            trainable.optimizer.load_state_dict(state["optimizer"])
    for name in ("scheduler", "scaler"):
        obj = getattr(trainable, name)
        if obj is not None and name in state:
            obj.load_state_dict(state[name])
    extras = state.get("extras", {})
    for key, obj in trainable.extras.items():
        if key not in extras:  # added to the spec since the save: left as build() made it
            continue
        if isinstance(obj, torch.Generator):
            obj.set_state(extras[key][GENERATOR_STATE])
        else:
            obj.load_state_dict(extras[key])
    spec.load_state_dict(state.get("spec", {}))
    set_rng_state(state["rng"])
    progress = state["progress"]
    return int(progress["epoch"]), int(progress["step"]), int(progress.get("in_epoch", 0))


GENERATOR_STATE = "generator_state"  # a torch.Generator in extras is saved as {this: get_state()}


def _extra_state(obj: Any) -> Any:
    return {GENERATOR_STATE: obj.get_state()} if isinstance(obj, torch.Generator) else obj.state_dict()


def _keyed_by_name(optimizer: Any) -> bool:
    """Whether an optimizer state is keyed by parameter names (a sharded save's), not numbers."""
    per_param = optimizer.get("state") if isinstance(optimizer, Mapping) else None
    return isinstance(per_param, Mapping) and bool(per_param) and all(isinstance(k, str) for k in per_param)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds DTensors (FSDP2, tensor parallel): saved through DCP, shard by shard."""
    tensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists
    return tensor is not None and any(isinstance(p, tensor.DTensor) for p in model.parameters())


RANK_KEYS = ("rng", "spec")  # what differs between the ranks of a multi-process run


def split_ranked(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A captured state as (replicated, this rank's own): RNG states and the spec's state are per rank."""
    shared = {k: v for k, v in state.items() if k not in RANK_KEYS}
    return shared, {k: state[k] for k in RANK_KEYS if k in state}


def run_epoch(
    spec: TrainingSpec, trainable: Trainable, epoch: int, rng: Mapping[str, Any] | None
) -> tuple[dict[str, float], int, dict[str, Any]]:
    """Train and evaluate one epoch from RNG states ``rng``: (finite float metrics, steps, RNG after)."""
    if rng is not None:
        set_rng_state(rng)
    metrics = dict(spec.train_epoch(trainable, epoch))
    metrics.update(spec.evaluate(trainable, epoch))
    after = rng_state()
    steps = int(metrics.pop("steps", 0))
    clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    return clean, steps, after


def state_differences(saved: Mapping[str, Any], built: Mapping[str, Any], *, show: int = 3) -> list[str]:
    """How a saved module state's keys and shapes differ from a built module's, one line per kind
    (shapes, missing keys, unexpected keys), naming the first ``show`` of each."""
    shapes = [(k, _shape(saved[k]), _shape(v)) for k, v in built.items() if k in saved]
    changed = [f"{k} saved {a}, built {b}" for k, a, b in shapes if a != b]
    kinds = [  # (one, several, what, items)
        ("tensor differs", "tensors differ", "in shape", changed),
        ("key", "keys", "of the model not in the checkpoint", [k for k in built if k not in saved]),
        ("key", "keys", "of the checkpoint not in the model", [k for k in saved if k not in built]),
    ]
    lines = []
    for one, several, what, items in kinds:
        if items:
            more = f"; and {len(items) - show} more" if len(items) > show else ""
            counted = f"{len(items)} {one if len(items) == 1 else several}"
            lines.append(f"{counted} {what}: {'; '.join(items[:show])}{more}.")
    return lines


def _shape(value: Any) -> list[int] | None:
    return list(value.shape) if hasattr(value, "shape") else None


def generator_seeds(spec: TrainingSpec) -> dict[int, int]:
    """The seed (``initial_seed()``) of each generator the spec keeps, by identity: taken after
    ``build()``, so that :func:`unsaved_generators` can tell a generator the spec seeds again."""
    return {id(g): g.initial_seed() for g, _ in _generators_of(spec)}


def unsaved_generators(
    spec: TrainingSpec, state: Mapping[str, Any], seeds: Mapping[int, int], *, epoch: int
) -> list[list[str]]:
    """The generators the spec keeps that ``state`` (a capture) will not restore, each as the
    attribute paths that reach it (``self.order``, ``self.loader.generator``).

    A generator is restored if its state is among the captured tensors (in ``extras``, or in the
    spec's own ``state_dict``). One that ``build()`` made and the spec has seeded again since
    (``seeds``: the seeds after ``build()``), or one made in ``epoch`` by
    :func:`~ckptflow.tasks.spec.epoch_generator`, needs no saving.
    """
    found = _generators_of(spec)
    if not found:
        return []
    per_epoch = epoch_generator(spec.seed, epoch).initial_seed()
    sizes = {g.get_state().numel() for g, _ in found}
    captured = {t.numpy().tobytes() for t in _byte_tensors(state) if t.numel() in sizes}
    lost = []
    for generator, paths in found:
        seed, built = generator.initial_seed(), seeds.get(id(generator))
        reseeded = seed != built if built is not None else seed == per_epoch
        if reseeded:  # the spec seeds it each epoch: its state at a save does not matter
            continue
        if generator.get_state().numpy().tobytes() not in captured:
            lost.append(paths)
    return lost


_REACH = ("generator", "sampler.generator")  # a DataLoader's (or a sampler's), its sampler's
_ITEMS = 32  # how many items of a list, tuple or dict attribute are looked into (more is data)


def _generators_of(spec: TrainingSpec) -> list[tuple[torch.Generator, list[str]]]:
    """The torch generators the spec's attributes hold, and the attribute paths to each: an
    attribute itself, one level into a list, tuple or dict, and a DataLoader's or sampler's."""
    found: dict[int, tuple[torch.Generator, list[str]]] = {}

    def note(value: Any, path: str) -> None:
        if isinstance(value, torch.Generator):
            found.setdefault(id(value), (value, []))[1].append(path)
            return
        if isinstance(value, (torch.Tensor, torch.nn.Module, str, bytes, int, float)):
            return
        for chain in _REACH:
            reached: Any = value
            for name in chain.split("."):
                try:
                    reached = getattr(reached, name, None)
                except Exception:  # a property that fails: nothing to find there
                    reached = None
            if isinstance(reached, torch.Generator):
                note(reached, f"{path}.{chain}")

    for name, value in vars(spec).items():
        note(value, f"self.{name}")
        if isinstance(value, dict):
            items: list[tuple[Any, Any]] = list(itertools.islice(value.items(), _ITEMS))
        else:
            items = list(enumerate(value[:_ITEMS])) if isinstance(value, (list, tuple)) else []
        for key, item in items:
            note(item, f"self.{name}[{key!r}]")
    return list(found.values())


def _byte_tensors(value: Any) -> list[torch.Tensor]:
    """The uint8 tensors in a captured state (a generator's state is one)."""
    if isinstance(value, torch.Tensor):
        return [value.detach().cpu()] if value.dtype == torch.uint8 and value.dim() == 1 else []
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _byte_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _byte_tensors(v)]
    return []


class Snapshot:
    """A private deep copy of the training state, to restart an epoch from."""

    def __init__(
        self,
        trainable: Trainable,
        spec: TrainingSpec,
        *,
        epoch: int,
        step: int,
        in_epoch: int = 0,
        rng: Mapping[str, Any] | None = None,
    ) -> None:
        state = capture(trainable, spec, epoch=epoch, step=step, in_epoch=in_epoch, rng=rng)
        self._state = copy.deepcopy(state)

    def restore(self, trainable: Trainable, spec: TrainingSpec) -> tuple[int, int, int]:
        # A fresh copy each time: Optimizer.load_state_dict adopts the given tensors (it does not
        # copy them), so the next attempt's in-place updates would otherwise change the snapshot.
        return restore(trainable, spec, copy.deepcopy(self._state))
