"""A Lightning fit whose checkpoints go through CkptflowCheckpointIO, for tests/integrations.

    python tests/children/lightning_child.py DIRPATH OUT --epochs N [--kill-at-epoch K]
                                           [--resume] [--async-save] [--store URL]

Fits a small regression model on fixed data (no shuffling, no dropout: the run is a
function of its seed) with ``ModelCheckpoint(dirpath=DIRPATH, save_last=True,
save_top_k=2, monitor="val_loss")``. ``--kill-at-epoch K`` SIGKILLs the process when
epoch K (0-based) starts; ``--resume`` fits with ``ckpt_path="last"``. At the end the
model's weights go to OUT (torch.save of a state dict of tensors), and the process
prints ``started at epoch E`` as its first line of output and ``done`` as its last.
``storage_options`` come as JSON in ``CKPTFLOW_STORAGE_OPTIONS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import pathlib
import signal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ckptflow.storage.integrations.lightning import CkptflowCheckpointIO


class Regressor(pl.LightningModule):
    def __init__(self, hparams_ns: argparse.Namespace, data_dir: pathlib.Path, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()  # a Namespace and a Path: tagged in the store, given back as such
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {
            "optimizer": opt,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        }


@dataclasses.dataclass
class Width:
    hidden: int
    depth: int


class Optim(enum.Enum):
    ADAM = "adam"
    SGD = "sgd"


class Configured(pl.LightningModule):
    """A module built from a dataclass, an enum and a loss module, all in its hyper-parameters."""

    def __init__(self, width: Width, optim: Optim, loss_fn: torch.nn.Module) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.loss_fn = loss_fn
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width.hidden), torch.nn.Tanh(), torch.nn.Linear(width.hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Reporter(pl.Callback):
    def __init__(self, kill_at: int | None) -> None:
        self.kill_at = kill_at

    def on_train_start(self, trainer, pl_module):
        assert isinstance(pl_module.hparams.hparams_ns, argparse.Namespace)
        assert isinstance(pl_module.hparams.data_dir, pathlib.Path)
        print(f"started at epoch {trainer.current_epoch}", flush=True)

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirpath")
    p.add_argument("out")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--kill-at-epoch", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--store")
    args = p.parse_args()
    options = json.loads(os.environ.get("CKPTFLOW_STORAGE_OPTIONS", "{}"))

    pl.seed_everything(0, verbose=False)
    model = Regressor(argparse.Namespace(width=32, act="tanh"), pathlib.Path("/data/regression"))
    io = CkptflowCheckpointIO(args.store, storage_options=options, async_save=args.async_save)
    checkpoints = pl.callbacks.ModelCheckpoint(
        dirpath=args.dirpath, save_last=True, save_top_k=2, monitor="val_loss"
    )
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        plugins=[io],
        callbacks=[checkpoints, Reporter(args.kill_at_epoch)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(
        model,
        DataLoader(data(), batch_size=16),
        DataLoader(data(1), batch_size=32),
        ckpt_path="last" if args.resume else None,
    )
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    print("done", flush=True)


if __name__ == "__main__":
    main()
