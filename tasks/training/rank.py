"""One rank of a run: its objects, and the requests of the trainer protocol carried out on them.

Every trainer is made of ranks, and every rank is this object: the flow's own
process holds one (:class:`~.in_process.InProcessTrainer`, a world of one), and
each process of a torch.distributed world holds one (:mod:`.rank_worker`, which
reads the requests off the channel). So a run is built, trained and saved by the
same code whichever kind of trainer drives it, and a save is dispatched in one
place (:meth:`Rank.save`).

What must hold:

- The save mode is the config's (``async_save``), fixed by :meth:`Rank.build`.
  An async save returns once its state is copied; a sync save writes the live
  tensors in a thread of its own, and nothing trains until it has ended (the
  flow waits for it before it asks for the next epoch).
- Every save in flight ends, committed or failed, before the rank leaves
  (:meth:`Rank.finish`): nothing half-written is given up.
- :attr:`Rank.progress` changes only once a stretch has trained through (or the
  run is built), in one assignment: an answer sent meanwhile from another
  thread carries either the old progress or the new one, never half of each.
- A stop (:meth:`Rank.request_stop`: a cancellation; :meth:`Rank.terminate`:
  SIGTERM) ends a spec's ``train_steps`` after the step in progress, at the same
  step on every rank (they agree after each step). After SIGTERM the rank
  saves that step itself (:meth:`Rank.preempt`), then raises :class:`Preempted`:
  the flow that would have saved it is going away.

No Prefect here; torch is imported by what builds and trains.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ckptflow.storage import CheckpointStore, VersionInfo

from ..cadence import Cadence
from ..config import PipelineConfig
from .protocol import Built, Committed, Done, Notes, PendingSave, Progress, Staged, Trained
from .run_state import (
    EpochAttempts,
    RunState,
    build_run,
    capture_run,
    restore_committed,
    save_options,
    train_attempt,
)


class Preempted(BaseException):
    """SIGTERM stopped the training: where it stood is saved (or the grace period ran out)."""


class _Writing:
    """A sync save, written from the live tensors in a thread of its own (not a daemon: a save in
    progress holds the process open): a :class:`PendingSave`, as an async save's storage
    ``SaveHandle`` is. ``wait`` raises the write's own error."""

    def __init__(self, version: int, write: Callable[[], VersionInfo]) -> None:
        self.version = version
        self._future: Future[VersionInfo] = Future()
        threading.Thread(target=self._run, args=(write,), name="ckptflow-save", daemon=False).start()

    def _run(self, write: Callable[[], VersionInfo]) -> None:
        try:
            self._future.set_result(write())
        except BaseException as exc:
            self._future.set_exception(exc)

    def wait(self, timeout: float | None = None) -> VersionInfo:
        return self._future.result(timeout)

    def on_commit(self, callback: Callable[[VersionInfo], None]) -> None:
        def done(future: Future[VersionInfo]) -> None:
            if future.exception() is None:
                callback(future.result())

        self._future.add_done_callback(done)

    def done(self) -> bool:
        return self._future.done()

    def join(self, timeout: float | None = None) -> bool:
        try:
            self._future.exception(timeout)
        except TimeoutError:
            return False
        return True

    def resubmit(self) -> None:
        """Nothing: a failed sync save is saved again by the next request, not written again."""


class Rank:
    """The run's objects in one rank of a world of ``world_size``, and the requests it carries out."""

    def __init__(self, *, world_size: int = 1, rank: int = 0) -> None:
        self.world_size = world_size
        self.rank = rank
        self.run: RunState | None = None
        self.async_save = True
        self.progress = Progress()
        self.in_steps = False  # a spec's train_steps is running: a stop waits for the step's end
        self.stop = threading.Event()  # stop after the step in progress
        self.terminating: float | None = None  # when SIGTERM came (time.monotonic)
        self.grace = 25.0
        self._attempts: EpochAttempts | None = None
        self._saves: dict[int, PendingSave] = {}
        self._saved: tuple[int, int, int] | None = None  # where the run stood at the last save started
        self._saved_version: int | None = None  # ... and its version (None: the position it was built at)

    def _built(self) -> RunState:
        if self.run is None:
            raise RuntimeError("this rank has not built its run")
        return self.run

    def build(self, config: PipelineConfig, store: CheckpointStore, *, writes: bool, log: Notes) -> Built:
        """Build the run of ``config`` on ``store``; restore its newest committed version.

        ``writes=False``: change nothing in the store (the flow holds its lease, and claims it).
        """
        import torch

        run = build_run(
            config,
            store,
            info=lambda message: log("info", message),
            warn=lambda message: log("warning", message),
            writes=writes,
            world_size=self.world_size,
            rank=self.rank,
        )
        self.run = run
        self.async_save = config.async_save
        self.grace = config.stop_grace_seconds
        self._saved = _position(run)  # its commit, or nothing trained yet: nothing to save on a stop
        self._set_progress(run)
        from ..spec import trains_by_steps

        if self.rank == 0 and Cadence.of(config).inside_epochs and not trains_by_steps(run.spec):
            log(
                "warning",
                f"{type(run.spec).__name__} implements train_epoch, not train_steps: step and minute "
                "saves are made at the end of the epoch in which they fall due (see the README's "
                "'Checkpoints inside epochs')",
            )
        return Built(
            resumed_from=run.resumed_from,
            metrics=run.metrics,
            planned_epochs=run.planned_epochs,
            identity=run.identity,
            threads=torch.get_num_threads(),
            world_size=self.world_size,
        )

    def train(self, epoch: int, *, keep_snapshot: bool, log: Notes, until: int | None = None) -> Trained:
        """An attempt at ``epoch`` from where the run stands, to its end or (a spec that trains by
        steps) its next save point or a stop; ``until``: exactly to that optimizer step. The first
        attempt of a stretch keeps its start state (``keep_snapshot``), a later one (a retry after
        an error) restores it first."""
        run = self._built()
        if self._attempts is None or self._attempts.done or self._attempts.epoch != epoch:
            if epoch != run.epoch + 1:
                raise RuntimeError(
                    f"asked to train epoch {epoch}, but these trainers stand at epoch {run.epoch}"
                )
            self._attempts = EpochAttempts(run, keep_snapshot=keep_snapshot, saved=self._saved_here(run))
        self._attempts.count += 1
        from ..spec import trains_by_steps

        self.in_steps = trains_by_steps(run.spec)
        try:
            stretch = train_attempt(
                run,
                epoch,
                self._attempts,
                lambda message: log("warning", message),
                pause=self._pause,
                until=until,
            )
        finally:
            self.in_steps = False
        self._attempts.done = True
        self._set_progress(run)
        terminating = self.terminating is not None  # SIGTERM, seen by the last pause or since
        if self.world_size > 1:  # ... on any rank: every rank saves, or none
            (terminating,) = _agreed(terminating)
        if terminating:
            self.terminate()
            try:
                self.preempt(log)
            except Exception as exc:  # the process ends all the same; what committed is intact
                _quiet(log)("error", f"the save on stopping failed: {type(exc).__name__}: {exc}")
            raise Preempted()
        return Trained(metrics=stretch.metrics, stopped=stretch.stopped, due=stretch.due)

    def _saved_here(self, run: RunState) -> Callable[[], None] | None:
        """How to put the run back where it stands from the save made there (None: none was),
        for a retried stretch: its commit is waited for, then read into the live objects."""
        version = self._saved_version
        if version is None and run.resumed_from is not None:
            version = run.resumed_from.version  # the version the run was built from
        if self._saved != _position(run) or version is None:
            return None
        saving = self._saves.get(version)

        def restore() -> None:
            if saving is not None:
                saving.wait()  # committed, or its error: the stretch cannot be retried then
            restore_committed(run, version, ranked=self.world_size > 1 or self._sharded(run))

        return restore

    @staticmethod
    def _sharded(run: RunState) -> bool:
        from .training_state import is_sharded

        return is_sharded(run.local()[1].model)

    def _set_progress(self, run: RunState) -> None:
        length = run.spec.steps_per_epoch(run.epoch + 1) if run.in_epoch else None
        self.progress = Progress(epoch=run.epoch, step=run.step, in_epoch=run.in_epoch, epoch_steps=length)

    def _pause(self, run: RunState) -> tuple[bool, bool]:
        """After a step: (a step or minute save is due, a stop was asked), the same on every rank."""
        cadence = Cadence.of(run.config)
        due = cadence.steps_due(run.step - 1, run.step)
        timed = cadence.time_due(time.monotonic() - run.saved_at)
        stop, terminating = self.stop.is_set(), self.terminating is not None
        if self.world_size > 1:  # every rank pauses after the same step
            timed, stop, terminating = _agreed(timed, stop, terminating)
            if terminating and self.terminating is None:
                self.terminating = time.monotonic()
        return due or timed, stop or terminating

    def request_stop(self) -> None:
        """Stop after the step in progress (a cancellation): the stretch ends ``stopped``."""
        self.stop.set()

    def terminate(self) -> None:
        """SIGTERM: stop after the step in progress, save it (:meth:`preempt`) and leave."""
        if self.terminating is None:
            self.terminating = time.monotonic()
        self.stop.set()

    def preempt(self, log: Notes) -> VersionInfo | None:
        """Save where the run stands, unless a save of it was started, and wait for the saves to
        commit within the grace period (counted from SIGTERM); the version saved, if any."""
        run = self.run
        if run is None or (self._attempts is not None and not self._attempts.done):
            return None  # not built, or its last stretch failed part-way: nothing whole to save
        began = self.terminating if self.terminating is not None else time.monotonic()
        log = _quiet(log)  # the flow may be gone: its notes must not stop the save
        info = None
        saved = self._saved == _position(run)  # a save of where the run stands was started, or it
        started = self._saves.get(self._saved_version) if saved and self._saved_version is not None else None
        if started is not None:  # ... its write must commit, or it is made again below
            started.join(max(0.0, self.grace - (time.monotonic() - began)))
            saved = not _failed(started)
        if not saved:
            where = f"step {run.in_epoch} of epoch {run.epoch + 1}" if run.in_epoch else f"epoch {run.epoch}"
            log("info", f"stopping: saving {where} before the process ends")
            (shared, own), kwargs = self._capture(None, log)
            with contextlib.suppress(Exception):  # an earlier async save's failure, raised by the next
                run.store.wait()
            info = run.store.save(shared, rank_state=own, **kwargs)
            self._saved = _position(run)
            log(
                "info",
                f"saved version {info.version} {time.monotonic() - began:.2f}s after the stop was asked",
            )
        for saving in list(self._saves.values()):
            saving.join(max(0.0, self.grace - (time.monotonic() - began)))
        return info

    def save(self, version: int, *, log: Notes) -> Staged:
        """Start the save of where the run stands as ``version``, in the run's mode."""
        run = self._built()
        if self.rank == 0 and run.order is not None and run.in_epoch:  # told once, at a save inside an epoch
            trap = run.order.trap(run.spec)
            if trap is not None:
                log("warning", trap)
        (shared, own), kwargs = self._capture(version, log)
        saving: PendingSave
        if self.async_save:
            saving = run.store.save_async(shared, rank_state=own, **kwargs)
        else:
            saving = _Writing(version, lambda: run.store.save(shared, rank_state=own, **kwargs))
        self._saves[version] = saving  # kept until the run stops: the flow may wait for it late
        self._saved, self._saved_version = _position(run), version
        return Staged(version=version)

    def _capture(
        self, version: int | None, log: Notes
    ) -> tuple[tuple[dict[str, Any], dict[str, Any] | None], dict[str, Any]]:
        """The state to save (shared, this rank's own), and the save's arguments."""
        from .training_state import is_sharded, split_ranked

        run = self._built()
        run.saved_at = time.monotonic()
        kwargs = save_options(run, version)
        state = capture_run(run, lambda message: log("warning", message))
        if self.world_size == 1 and not is_sharded(run.local()[1].model):  # sharded: RNGs stay apart
            return (state, None), kwargs
        return split_ranked(state), kwargs

    def wait(self, version: int) -> Committed:
        """Wait until the save of ``version`` is committed; its error if it failed."""
        return Committed(info=self.saving(version).wait())

    def resubmit(self, version: int) -> Done:
        self.saving(version).resubmit()
        return Done()

    def saving(self, version: int) -> PendingSave:
        """The save of ``version`` that this rank started (in flight, or ended since)."""
        saving = self._saves.get(version)
        if saving is None:
            raise RuntimeError(f"no save of version {version} was started by these trainers")
        return saving

    def finish(self) -> None:
        """Let every save end (committed or failed)."""
        for saving in list(self._saves.values()):
            saving.join()

    def close(self) -> None:
        """:meth:`finish`, then release the store's staging memory (a rank that leaves)."""
        self.finish()
        if self.run is not None:
            self.run.store.close()


def _failed(saving: PendingSave) -> bool:
    """Whether a save that ended failed (one still running has not)."""
    if not saving.done():
        return False
    try:
        saving.wait(0)
    except Exception:
        return True
    return False


def _quiet(log: Notes) -> Notes:
    def noted(level: str, message: str) -> None:
        with contextlib.suppress(Exception):
            log(level, message)

    return noted


def _position(run: RunState) -> tuple[int, int, int]:
    return run.epoch, run.step, run.in_epoch


def _agreed(*flags: bool) -> tuple[bool, ...]:
    """``flags`` or-ed over the ranks (one small all-reduce)."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    values = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in values.tolist())
