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

SIGTERM while a spec's ``train_steps`` runs (a worker's cancellation, Kubernetes)
waits for the step in progress: the rank saves that step, and only then is
Prefect's own handler called (it raises ``TerminationSignal`` in the flow). An
interrupted run that stood between stretches saves where it stands when it stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from ckptflow.storage import VersionInfo

from ..config import PipelineConfig
from .protocol import Built, Notes, PendingSave, Progress, Trained
from .rank import Preempted, Rank
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
        from .childenv import FLOW_RUN_ENV
        from .threads import torch_threads

        if flow_run:  # the run its saves record (lineage), as a rank worker has it
            os.environ[FLOW_RUN_ENV] = flow_run
        else:
            os.environ.pop(FLOW_RUN_ENV, None)

        threads = self._threads.enter_context(torch_threads(self.config.torch_threads))
        log("info", f"torch intra-op threads: {threads} of {os.cpu_count() or 1} cores")
        return self._rank.build(self.config, self.store, writes=True, log=log)

    def train(self, epoch: int, *, keep_snapshot: bool, log: Notes, until: int | None = None) -> Trained:
        with self._sigterm_after_step() as terminated:
            try:
                return self._rank.train(epoch, keep_snapshot=keep_snapshot, log=log, until=until)
            except Preempted:
                terminated()
                raise

    @contextlib.contextmanager
    def _sigterm_after_step(self) -> Iterator[Any]:
        """While training (in the main thread): SIGTERM asks the rank to stop after the step in
        progress and save it; the handler it replaced (Prefect's) is called once that is done."""
        if threading.current_thread() is not threading.main_thread():
            yield lambda: None
            return
        previous = signal.getsignal(signal.SIGTERM)
        frames: list[Any] = []

        def stop(signum: int, frame: Any) -> None:
            frames.append(frame)
            again = self._rank.terminating is not None
            self._rank.terminate()
            if not self._rank.in_steps and not again:  # a whole epoch: the previous handler interrupts it now
                signal.signal(signal.SIGTERM, previous)
                _call(previous, signum, frame)

        def terminated() -> None:
            signal.signal(signal.SIGTERM, previous)
            _call(previous, signal.SIGTERM, frames[-1] if frames else None)

        signal.signal(signal.SIGTERM, stop)
        try:
            yield terminated
        finally:
            signal.signal(signal.SIGTERM, previous)

    def save(self, version: int, *, log: Notes) -> PendingSave:
        """The save's own handle: a storage SaveHandle (async), or the sync write's."""
        self._rank.save(version, log=log)
        return self._rank.saving(version)

    def request_stop(self) -> None:
        self._rank.request_stop()

    def wait(self, version: int, timeout: float | None = None) -> VersionInfo | None:
        return self._rank.saving(version).wait(timeout)

    def stop(self, *, interrupted: bool = False, preempted: bool = False) -> None:
        """The saves in flight end first (``preempted``: where the run stands is saved first);
        then torch's threads are put back."""
        try:
            if preempted:
                self._rank.terminate()
                self._rank.preempt(_to_logger)
            self._rank.finish()
        finally:
            self._threads.close()


def _call(handler: Any, signum: int, frame: Any) -> None:
    """Run a signal handler as the signal would (the default action: re-deliver the signal)."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _to_logger(level: str, message: str) -> None:
    getattr(logging.getLogger("ckptflow.run"), level)(message)
