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


class TimedSteppedDigits(DigitsSpec):
    """The demo trained by steps, marking its first step and each epoch's end (bench_steps.py)."""

    def train_steps(self, trainable, epoch, start):  # type: ignore[no-untyped-def]
        steps = super().train_steps(trainable, epoch, start)
        first = epoch == 1 and start == 0
        while True:
            try:
                next(steps)
            except StopIteration as end:
                TimedDigits.mark("epoch_end")
                return end.value
            if first:
                TimedDigits.mark("first_step")
                first = False
            yield
