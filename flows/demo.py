"""The demo's training spec: a small MLP on scikit-learn's digits, offline.

``load_digits`` ships inside scikit-learn (1,797 8x8 images, nothing is
downloaded). The spec follows the rules that make resume bitwise exact: the
data order of an epoch comes from a generator seeded with (seed, epoch), and
dropout draws from torch's global RNG, which every checkpoint saves. It trains
step by step (``train_steps``), so a run can save and resume inside an epoch:
the batches of an epoch are a slice of that order, and the loss summed so far
is the spec's own state.

Run with several processes (``--nproc N``), it trains data-parallel the usual
way: the raw model stays in ``Trainable.model`` (so checkpoints have the same
keys whatever the number of ranks), a ``DistributedDataParallel`` wrapper
averages the gradients, and each rank takes its slice of every batch.

Use it as the template for your own spec: ``--spec your.module:YourSpec``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Generator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ckptflow.tasks.spec import Trainable, TrainingSpec, epoch_generator


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (1797 x 64 pixels, and labels), read from the file scikit-learn ships.

    Reading the file directly avoids importing ``sklearn.datasets`` (0.6 s, with
    scipy), which every ``ckptflow run`` would wait for; ``load_digits`` is the
    fallback should the file move.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the demo needs scikit-learn: pip install 'ckptflow[demo]'")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    if os.path.exists(path):
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn import datasets

    digits = datasets.load_digits()
    return digits.data, digits.target


class DigitsSpec(TrainingSpec):
    """Config keys: hidden (128), lr (1e-3), batch_size (64), dropout (0.1), val_fraction (0.2).

    It trains step by step (``train_steps``): checkpoints can be made, and resumed, inside epochs.
    """

    sums: tuple[float, int] = (0.0, 0)

    def build(self) -> Trainable:
        data, target = load_digits()
        x = torch.tensor(data, dtype=torch.float32) / 16.0
        y = torch.tensor(target, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        n_val = int(len(x) * float(self.config.get("val_fraction", 0.2)))
        self.val = (x[order[:n_val]], y[order[:n_val]])
        self.train = (x[order[n_val:]], y[order[n_val:]])
        hidden = int(self.config.get("hidden", 128))
        model = nn.Sequential(
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Dropout(float(self.config.get("dropout", 0.1))),
            nn.Linear(hidden, 10),
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=float(self.config.get("lr", 1e-3)))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
        return Trainable(model=model, optimizer=optimizer, scheduler=scheduler)

    def train_steps(
        self, trainable: Trainable, epoch: int, start: int
    ) -> Generator[None, None, dict[str, float]]:
        """One step per batch; resumed at ``start``, it skips the batches trained already (the
        epoch's order depends only on (seed, epoch)) and takes the loss sums so far from its state."""
        model, opt = trainable.model, trainable.optimizer
        assert opt is not None
        x, y = self.train
        order = torch.randperm(len(x), generator=epoch_generator(self.seed, epoch))
        rank, world = _rank_and_world()
        net = self._data_parallel(model) if world > 1 else model
        model.train()
        if start == 0:
            self.sums = (0.0, 0)  # this rank's loss sum and samples in the epoch so far
        for whole in self._batches(order)[start:]:
            idx = whole[rank::world]
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            self.sums = (self.sums[0] + loss.item() * len(idx), self.sums[1] + len(idx))
            yield
        trainable.scheduler.step()
        total, seen = self.sums
        if world > 1:  # the epoch's loss over every rank's samples
            sums = torch.tensor([total, float(seen)], dtype=torch.float64)
            dist.all_reduce(sums)
            total, seen = float(sums[0]), int(sums[1])
        return {"loss": total / seen}

    def _batches(self, order: torch.Tensor) -> list[torch.Tensor]:
        """The epoch's batches: every rank needs a sample of each for the gradient average."""
        batch = int(self.config.get("batch_size", 64))
        world = _rank_and_world()[1]
        batches = [order[i : i + batch] for i in range(0, len(order), batch)]
        return [b for b in batches if len(b) >= world]

    def steps_per_epoch(self, epoch: int) -> int:
        return len(self._batches(torch.arange(len(self.train[0]))))

    def state_dict(self) -> dict[str, Any]:
        return {"loss_sum": self.sums[0], "samples": self.sums[1]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "loss_sum" in state:  # a checkpoint of an older demo holds none: saved at an epoch's end
            self.sums = (float(state["loss_sum"]), int(state["samples"]))

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        if getattr(self, "_ddp", None) is None:
            self._ddp = nn.parallel.DistributedDataParallel(model)
        return self._ddp

    def evaluate(self, trainable: Trainable, epoch: int) -> dict[str, float]:  # the same on every rank
        model = trainable.model
        x, y = self.val
        model.eval()
        with torch.no_grad():
            logits = model(x)
        return {
            "val_loss": float(nn.functional.cross_entropy(logits, y)),
            "val_acc": float((logits.argmax(1) == y).float().mean()),
        }


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
