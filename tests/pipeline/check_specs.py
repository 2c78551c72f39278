"""Specs for ``ckptflow check`` (tests/pipeline/test_check.py): ways a step-level spec resumes, or not.

- :class:`ShuffledLoaderSpec` is what a user writes from habit: a ``DataLoader(shuffle=True,
  generator=g)``, ``g`` in ``extras``, ``start`` batches skipped. A resume inside an epoch trains
  the rest of it in another order: the check fails it, and the run warns at its first save.
- :class:`ReseededLoaderSpec` makes the order from ``(seed, epoch)`` each epoch: it resumes bitwise.
- :class:`ReseededExtrasSpec` keeps its generator in ``extras`` but seeds it again from
  ``(seed, epoch)`` at each epoch's start: it resumes bitwise, and is not warned.
- :class:`DropoutGeneratorSpec` draws from a generator in ``extras`` at every step (its own
  dropout): restoring it is right, so it resumes bitwise and is not warned.
- :class:`ForgetfulSpec` sums the epoch's loss in a plain attribute its ``state_dict`` leaves out:
  the epoch's metrics differ after a resume inside it.
- :class:`UnseededSpec` adds noise from a generator seeded by the clock: not deterministic at all.
- :class:`AccumulatingSpec` accumulates gradients over ``accumulate`` batches per optimizer step;
  with ``skip_batches`` it skips ``start`` batches instead of ``start * accumulate`` (a miscount).

Every spec trains a small MLP on fixed random data: ``batch_size`` 64 over 1,280 samples is 20 steps
an epoch (``samples`` in the config changes it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptflow.tasks.spec import Trainable, TrainingSpec, epoch_generator


class _Base(TrainingSpec):
    def data(self) -> TensorDataset:
        g = torch.Generator().manual_seed(self.seed)
        samples = int(self.config.get("samples", 1280))
        x = torch.randn(samples, 16, generator=g)
        return TensorDataset(x, (x[:, :4].sum(1) > 0).long())

    def model(self) -> Trainable:
        torch.manual_seed(self.seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        return Trainable(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))

    @property
    def batch(self) -> int:
        return int(self.config.get("batch_size", 64))

    def step(self, t: Trainable, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = nn.functional.cross_entropy(t.model(x), y)
        t.optimizer.zero_grad()
        loss.backward()
        t.optimizer.step()
        return loss.item()

    def steps_per_epoch(self, epoch: int) -> int:
        return -(-len(self.dataset) // self.batch)


class ShuffledLoaderSpec(_Base):
    """The trap: the loader's generator in extras, restored after the epoch's shuffle was drawn."""

    loss = 0.0

    def build(self) -> Trainable:
        self.dataset = self.data()
        self.order = torch.Generator().manual_seed(self.seed)
        self.loader = DataLoader(self.dataset, batch_size=self.batch, shuffle=True, generator=self.order)
        t = self.model()
        t.extras = {"order": self.order}
        return t

    def train_steps(self, t: Trainable, epoch: int, start: int) -> Iterator[object]:
        if start == 0:
            self.loss = 0.0
        for x, y in itertools.islice(self.loader, start, None):
            self.loss += self.step(t, x, y)
            yield
        return {"loss": self.loss}

    def state_dict(self) -> dict[str, Any]:
        return {"loss": self.loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.loss = state["loss"]


class ReseededLoaderSpec(ShuffledLoaderSpec):
    """The order from (seed, epoch), a new generator each epoch: nothing to restore."""

    def build(self) -> Trainable:
        self.dataset = self.data()
        return self.model()

    def train_steps(self, t: Trainable, epoch: int, start: int) -> Iterator[object]:
        self.loader = DataLoader(
            self.dataset, batch_size=self.batch, shuffle=True, generator=epoch_generator(self.seed, epoch)
        )
        return (yield from super().train_steps(t, epoch, start))


class ReseededExtrasSpec(ShuffledLoaderSpec):
    """The generator stays in extras, but each epoch seeds it again from (seed, epoch)."""

    def train_steps(self, t: Trainable, epoch: int, start: int) -> Iterator[object]:
        self.order.manual_seed(self.seed * 1_000_003 + epoch)
        return (yield from super().train_steps(t, epoch, start))


class DropoutGeneratorSpec(ReseededLoaderSpec):
    """A generator in extras drawn from at every step (a hand-made dropout mask): restoring it is right."""

    def build(self) -> Trainable:
        t = super().build()
        self.noise = torch.Generator().manual_seed(self.seed + 1)
        t.extras = {"noise": self.noise}
        return t

    def step(self, t: Trainable, x: torch.Tensor, y: torch.Tensor) -> float:
        keep = torch.rand(x.shape, generator=self.noise) > 0.1
        return super().step(t, x * keep, y)


class ForgetfulSpec(ReseededLoaderSpec):
    """Sums the epoch's loss but leaves the sum out of its state_dict."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class AccumulatingSpec(ReseededLoaderSpec):
    """``accumulate`` batches per optimizer step; ``start`` counts optimizer steps, so a resume skips
    ``start * accumulate`` batches (``skip_batches``: only ``start``, the miscount users make)."""

    def train_steps(self, t: Trainable, epoch: int, start: int) -> Iterator[object]:
        accumulate = int(self.config.get("accumulate", 2))
        skip = start if self.config.get("skip_batches") else start * accumulate
        if start == 0:
            self.loss = 0.0
        loader = DataLoader(
            self.dataset, batch_size=self.batch, shuffle=True, generator=epoch_generator(self.seed, epoch)
        )
        batches = itertools.islice(loader, skip, None)
        while chunk := list(itertools.islice(batches, accumulate)):
            t.optimizer.zero_grad()
            for x, y in chunk:
                loss = nn.functional.cross_entropy(t.model(x), y) / len(chunk)
                loss.backward()
                self.loss += loss.item()
            t.optimizer.step()
            yield
        return {"loss": self.loss}

    def steps_per_epoch(self, epoch: int) -> int:
        batches = -(-len(self.dataset) // self.batch)
        return -(-batches // int(self.config.get("accumulate", 2)))


class UnseededSpec(ReseededLoaderSpec):
    """Noise from a generator seeded from the OS at every step: two runs differ from their first step."""

    def step(self, t: Trainable, x: torch.Tensor, y: torch.Tensor) -> float:
        import os

        noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
        return super().step(t, x + 0.01 * torch.randn(x.shape, generator=noise), y)
