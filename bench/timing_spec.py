"""The demo spec, marking when epochs start and end (for bench_pipeline.py)."""

from __future__ import annotations

import os
import time

from ckptflow.flows.demo import DigitsSpec
from ckptflow.tasks.spec import Trainable


class TimedDigits(DigitsSpec):
    @staticmethod
    def mark(name: str) -> None:
        path = os.environ.get("CKPTFLOW_BENCH_TIMES")
        if path:
            with open(path, "a") as f:
                f.write(f"{name} {time.time()}\n")

    def train_epoch(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        if epoch == 1:
            self.mark("first_epoch")
        metrics = super().train_epoch(trainable, epoch)
        self.mark("epoch_end")
        return metrics
