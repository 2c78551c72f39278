"""The trainer that trains in the flow's own process (``train_process`` off): for a debugger.

It is the trainer protocol (:mod:`.protocol`) over a :class:`~.rank.Rank` of a
world of one, called directly: the same rank object the training processes
serve, so a run builds, trains and saves here exactly as it does there. Errors
are the rank's own, with their own tracebacks.

It writes to the store the flow reads (:attr:`InProcessTrainer.store`), so the
flow's writer lease covers its commits, and it builds with ``writes`` on: it
sets unreadable versions aside and records the run's identity itself, as the
flow holds the lease already. torch's intra-op threads are set for the run
(:mod:`.threads`) and put back when it stops.
"""

from __future__ import annotations

import contextlib
import os

from ckptflow.storage import VersionInfo

from .config import PipelineConfig
from .protocol import Built, Notes, PendingSave, Progress, Trained
from .rank import Rank
from .run_state import open_store


class InProcessTrainer:
    """A :class:`~.protocol.Trainer` whose one rank lives in this process."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.store = open_store(config)
        self.async_save = config.async_save
        self._rank = Rank()
        self._threads = contextlib.ExitStack()

    @property
    def progress(self) -> Progress:
        return self._rank.progress

    def build(self, *, flow_run: str | None, log: Notes) -> Built:
        from .threads import torch_threads

        threads = self._threads.enter_context(torch_threads(self.config.torch_threads))
        log("info", f"torch intra-op threads: {threads} of {os.cpu_count() or 1} cores")
        return self._rank.build(self.config, self.store, writes=True, log=log)

    def train(self, epoch: int, *, keep_snapshot: bool, log: Notes) -> Trained:
        return self._rank.train(epoch, keep_snapshot=keep_snapshot, log=log)

    def save(self, epoch: int, *, log: Notes) -> PendingSave:
        """The save's own handle: a storage SaveHandle (async), or the sync write's."""
        self._rank.save(epoch, log=log)
        return self._rank.saving(epoch)

    def wait(self, version: int, timeout: float | None = None) -> VersionInfo | None:
        return self._rank.saving(version).wait(timeout)

    def stop(self, *, interrupted: bool = False) -> None:
        """The saves in flight end first; then torch's threads are put back."""
        try:
            self._rank.finish()
        finally:
            self._threads.close()
