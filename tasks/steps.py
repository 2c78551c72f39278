"""The pipeline's Prefect tasks: init, train an epoch, save, commit, finalize.

Each task is a thin wrapper over the run's :class:`~.protocol.Trainer` and
``ckptflow.storage``. Where the model trains is decided once, by ``init_model``
(``train_process``: in training processes, :mod:`.trainer`, or in this one,
:mod:`.in_process`); the other tasks drive the trainer they are given and never
ask which kind it is. Each task is safe to retry:

- ``init_model`` builds everything from scratch on every attempt.
- ``train_epoch``: trains an epoch, or (a spec that trains by steps) its steps
  up to the next save point or stop; the trainer restores the state captured
  at the start of that stretch before a retried attempt, so a retry never
  continues a half-updated model. It also puts back the RNG states the previous epoch ended with, and
  the checkpoint saves those: the process's global RNGs are shared with Prefect
  (retry jitter draws from ``random`` in the flow's thread), and draws made
  between epochs must not reach training. Draws by other threads *during* an
  epoch cannot be kept out (Prefect's events client pings its websocket with
  ``random.getrandbits``): a spec that needs a bitwise resume should not draw
  from Python's global ``random``. Trainers that died are replaced, and stand
  where the run stood, before they are asked anything.
- ``save_checkpoint`` writes the version number the flow chose for the save
  point (the next number, and at least the epoch's: a run that saves only at
  epoch ends has version = epoch): a retry after a crash clears the leftovers
  and writes the same version again, and a retry after the commit finds the
  version committed and returns it, so one save point yields one committed
  version, never two. Before it starts a save it applies the retention policy
  to what is committed, so a long run never holds more than the policy keeps
  and the save in flight.
- ``commit_checkpoint`` waits for an async save and, if the background write
  failed, writes the same staged state again on the next attempt.

The flow keeps no copy of where the run stands: :class:`TrainingRun` reads it
from its trainer, which has it from the trainer's last answer.

A save is waited for in a helper thread, and the task waits for it even when
the run is being cancelled (Prefect raises ``TerminationSignal`` in the main
thread): the save in progress finishes and commits, and nothing half-written
is exposed.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, cast

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff

from ckptflow.storage import (
    CheckpointError,
    CheckpointStore,
    LeaseLostError,
    PrunePlan,
    StateMismatchError,
    StoreLockedError,
    VersionInfo,
)

from .config import PipelineConfig, RetentionConfig
from .reporting.formatting import retention_line
from .reporting.monitoring import notify
from .retrying import failure_key, io_task, is_transient, refuse_retries, unless_refused
from .spec import SpecError
from .training import run_state
from .training.protocol import Built, Notes, PendingSave, Progress, Trained, Trainer, TrainerDiedError
from .training.run_state import RUN_FILE, ConfigMismatchError, NothingToResumeError


class SaveTimeoutError(TimeoutError):
    """A save did not commit within ``save_timeout_seconds``; its write goes on, and a retry waits for it."""


def open_store(config: PipelineConfig) -> CheckpointStore:
    return run_state.open_store(config)


@dataclass
class TrainingRun:
    """The run as the flow drives it: its trainer, what the build found, and where it began.

    Where the run stands now (:attr:`epoch`) is the trainer's last answer's, never a copy kept here.
    """

    config: PipelineConfig
    trainer: Trainer
    built: Built
    began: Progress  # where the build left the run: the epoch before the first this run trains
    writing: tuple[int, Future[Any]] | None = None  # (version, sync save) that outlived its task's timeout
    next_version: int = 0  # the lowest number the next save may take

    @property
    def progress(self) -> Progress:
        """Where the run stands (the trainer's last answer)."""
        return self.trainer.progress

    def version_for_save(self) -> int:
        """The number of a save of where the run stands: the next one, and at least the epoch's
        (a save inside an epoch: the epoch in progress), so that versions sort in training order
        and a run that saves at epoch ends only has version = epoch."""
        progress = self.trainer.progress
        return max(self.next_version, progress.epoch + (1 if progress.in_epoch else 0))

    @property
    def store(self) -> CheckpointStore:
        return self.trainer.store

    @property
    def epoch(self) -> int:
        """The last epoch trained."""
        return self.trainer.progress.epoch

    @property
    def first_epoch(self) -> int:
        return self.began.epoch + 1

    @property
    def resumed_from(self) -> VersionInfo | None:
        return self.built.resumed_from

    @property
    def planned_epochs(self) -> int:
        return self.built.planned_epochs

    @property
    def metrics(self) -> dict[int, dict[str, float]]:
        """The metrics of the epochs committed when the run was built (a resume's history)."""
        return self.built.metrics

    def close(self, *, interrupted: bool = False, preempted: bool = False) -> None:
        """Stop the trainer: the saves in flight commit first (``interrupted``: it gives up its
        stretch; ``preempted``: it saves where it stands first)."""
        self.trainer.stop(interrupted=interrupted, preempted=preempted)


@dataclass
class EpochTries:
    """The flow's record of one epoch's attempts (the trainer keeps its start state).

    ``failure``: how the last attempt failed (:func:`~ckptflow.tasks.retrying.failure_key`), so
    that the same failure twice ends the epoch's retries.
    """

    keep_snapshot: bool
    failure: tuple[str, str, str] | None = None


def _may_pass(task: Any, task_run: Any, state: Any) -> bool:
    """Retry init unless it failed on something only the user can change (config, spec path, a
    model that no longer fits the checkpoint)."""
    error = state.result(raise_on_failure=False)
    return not isinstance(error, (ConfigMismatchError, NothingToResumeError, SpecError, StateMismatchError))


@io_task("init_model", retries=2, retry_condition_fn=_may_pass)
def init_model(config: PipelineConfig) -> TrainingRun:
    """Build the spec's objects; restore the newest committed checkpoint if there is one.

    The trainer's kind is decided here, once: training processes with ``train_process``, else
    this process.
    """
    trainer = _trainer_for(config)
    run_id = flow_run.get_id()
    try:
        built = trainer.build(flow_run=str(run_id) if run_id else None, log=_log_to(get_run_logger()))
    except BaseException:
        trainer.stop(interrupted=True)
        raise
    known = [v.version for v in trainer.store.versions()]
    return TrainingRun(config, trainer, built, trainer.progress, next_version=max(known, default=-1) + 1)


def _trainer_for(config: PipelineConfig) -> Trainer:
    if config.uses_trainers:
        from .training.trainer import ProcessTrainer

        return ProcessTrainer.take(config)
    from .training.in_process import InProcessTrainer

    return InProcessTrainer(config)


def _stretch_name(parameters: dict[str, Any]) -> str:
    """``train_epoch-3``, or ``train_epoch-3-from-step-400`` for a stretch that starts inside it."""
    run: Any = parameters.get("run")
    epoch = parameters.get("epoch")
    run = run.unquote() if hasattr(run, "unquote") else run
    progress = getattr(getattr(run, "trainer", None), "progress", None)
    start = getattr(progress, "in_epoch", 0)
    return f"train_epoch-{epoch}" + (f"-from-step-{start}" if start else "")


def _save_name(parameters: dict[str, Any]) -> str:
    return f"save_checkpoint-v{parameters.get('version')}"


@task(
    name="train_epoch",
    cache_policy=NO_CACHE,
    retry_condition_fn=unless_refused,
    task_run_name=cast(Any, _stretch_name),
)
def train_epoch(run: TrainingRun, epoch: int, tries: EpochTries) -> Trained:
    """Run the spec's epoch (and evaluation), or its steps to the next save point or stop (the
    answer's ``metrics`` are None then; the run's progress says where it stands).

    A retry after the trainers died starts new ones from the last commit; a retry after an
    error in the epoch restores the epoch's start state. An error that repeats the previous
    attempt's exactly is not retried (see :mod:`.retrying`).
    """
    try:
        trained = run.trainer.train(epoch, keep_snapshot=tries.keep_snapshot, log=_log_to(get_run_logger()))
    except Exception as exc:
        if isinstance(exc, TrainerDiedError):  # a process that died is not a failure of the epoch's code
            tries.failure = None
            raise
        key = failure_key(exc)
        if key == tries.failure and not is_transient(exc):
            why = (
                f"epoch {epoch} failed as its previous attempt did ({key[0]} at {os.path.basename(key[2])}): "
                "not retried, since a retry replays the epoch from the same state"
            )
            get_run_logger().warning(why)
            refuse_retries(exc, why)
        tries.failure = key
        raise
    return trained


def _log_to(logger: Any) -> Notes:
    """A trainer's notes, to ``logger`` (a task's run logger: they show on that task)."""
    return lambda level, message: getattr(logger, level)(message)


@dataclass(frozen=True)
class SaveResult:
    """What ``save_checkpoint`` did: the new save (committed, or a handle) and the previous save's commit."""

    saved: VersionInfo | PendingSave
    previous: VersionInfo | None = None
    removed: tuple[int, ...] = ()  # what the retention policy removed before the save


def _save_may_pass(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a save unless another writer has the store or the version: a retry cannot change that."""
    error: BaseException | None = state.result(raise_on_failure=False)
    while error is not None:  # an async save's SaveFailedError carries the refusal as its cause
        if isinstance(error, (StoreLockedError, LeaseLostError, ForeignVersionError)):
            return False
        error = error.__cause__
    return True


class ForeignVersionError(CheckpointError):
    """The version a save would write is committed already, by another writer than this run."""


@io_task("save_checkpoint", retry_condition_fn=_save_may_pass, task_run_name=cast(Any, _save_name))
def save_checkpoint(
    run: TrainingRun,
    version: int,
    *,
    previous: PendingSave | None = None,
    timeout: float | None = None,
    retention: RetentionConfig | None = None,
    durable_from: int | None = None,
) -> SaveResult:
    """Commit the async save in flight, apply ``retention`` to what is committed, then save where
    the run stands as ``version``.

    Async saves (the run's mode, ``async_save``) return once the state is copied. Waiting for
    ``previous`` here, not in a task of its own, saves a task run per epoch; if its background
    write failed, it is written again from its staged bytes on the next attempt, before
    anything else. ``durable_from``: the first version the durable tier lacks, which retention keeps.

    ``timeout`` bounds each wait for a commit (SaveTimeoutError). A write is never started
    twice: a write that outlived its attempt goes on, and the next attempt waits for it.
    """
    committed = _commit_within(previous, timeout) if previous is not None else None
    removed = _retain(run.store, retention, durable_from) if retention is not None else ()
    if run.writing is not None and run.writing[0] == version:
        earlier = run.writing[1]
        try:
            info = _wait_for(earlier, timeout, version)
        except SaveTimeoutError:
            raise
        except Exception as exc:  # that write failed: write again below
            get_run_logger().warning("the earlier save of version %d failed (%s): saving again", version, exc)
        else:
            return SaveResult(info, committed, removed)
        finally:
            if earlier.done():
                run.writing = None
    existing = run.store.find(version)
    if existing is not None:
        if not run.store.committed_by_this_writer(version):  # never report another writer's version as ours
            raise ForeignVersionError(
                f"version {version} of {run.store.url} was committed by another writer, not by this run "
                f"(its manifest carries another lease): version {version} was not saved. Nothing was "
                "overwritten; see `ckptflow show` for what it holds, remove it if it is not wanted "
                "(`ckptflow prune`), and run again"
            )
        get_run_logger().info("version %d is already committed as %s", version, existing.url)
        return SaveResult(existing, committed, removed)
    save = run.trainer.save(version, log=_log_to(get_run_logger()))  # its notes show on this task
    if run.trainer.async_save:
        return SaveResult(save, committed, removed)
    future = _in_thread(save.wait)
    run.writing = (version, future)
    info = _wait_for(future, timeout, version)
    run.writing = None
    if info is None:  # its trainers died before it committed: the retry's new ones save it again
        raise TrainerDiedError(f"the trainers that were writing version {version} died before it committed")
    if retention is not None:
        removed += _retain(run.store, retention, durable_from)
    return SaveResult(info, committed, removed)


RETENTION_LINE_SECONDS = 60.0  # a run that saves often says what retention removed once a minute


@dataclass
class _Removed:
    """What retention removed in a run since its last line, and when that line was said."""

    versions: list[int]
    said_at: float | None = None


_unsaid: dict[str, _Removed] = {}  # by flow run


def _retain(store: CheckpointStore, policy: RetentionConfig, durable_from: int | None) -> tuple[int, ...]:
    """Apply the retention policy as the run goes; one line for what it removed, at most once a
    minute (a run saving every few seconds would say it at every save), the rest at the run's end."""
    if not policy.enabled():
        return ()
    plan = store.apply_retention(policy.policy(durable_from))
    if plan.remove:
        removed = _unsaid.setdefault(flow_run.get_id() or "", _Removed([]))
        removed.versions += plan.remove
        now = time.monotonic()
        if removed.said_at is None or now - removed.said_at >= RETENTION_LINE_SECONDS:
            _say_retention(policy, plan, removed.versions, durable_from)
            removed.versions, removed.said_at = [], now
    return tuple(plan.remove)


def _say_retention(
    policy: RetentionConfig, plan: PrunePlan, removed: list[int], durable_from: int | None = None
) -> None:
    """The retention line, of every version removed since the last one (``removed``)."""
    line = retention_line(policy, dataclasses.replace(plan, remove=tuple(sorted(removed))), durable_from)
    get_run_logger().info(line)
    notify("retention", {"text": line, "removed": sorted(removed), "kept": list(plan.remaining)})


@io_task("commit_checkpoint")
def commit_checkpoint(handle: PendingSave, timeout: float | None = None) -> VersionInfo | None:
    """Wait until an async save is committed; a failed write is redone on the next attempt.

    None: the trainers that were writing it died first (it is not committed; their replacements
    save it again).
    """
    return _commit_within(handle, timeout)


def _commit_within(handle: PendingSave, timeout: float | None) -> VersionInfo | None:
    try:
        info = _wait_for(_in_thread(handle.wait), timeout, handle.version)
    except SaveTimeoutError:
        raise  # still writing: the next attempt waits again
    except Exception:
        handle.resubmit()
        raise
    if info is None:
        get_run_logger().warning(
            "version %d was being written when the trainers died: it was not committed", handle.version
        )
    return cast(VersionInfo | None, info)


@task(name="finalize", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=exponential_backoff(1))
def finalize(store: CheckpointStore, policy: RetentionConfig, durable_from: int | None = None) -> list[int]:
    """Apply the retention policy (keeping the versions from ``durable_from`` on, which the durable
    tier lacks), say what it kept and removed; return the versions it removed."""
    store.wait()
    if not policy.enabled():
        return []
    plan = store.apply_retention(policy.policy(durable_from))
    unsaid = _unsaid.pop(flow_run.get_id() or "", _Removed([]))
    _say_retention(policy, plan, [*unsaid.versions, *plan.remove], durable_from)
    return list(plan.remove)


def _in_thread(call: Any) -> Future[Any]:
    """Start ``call`` in a thread of its own (not a daemon: a save in progress holds the process open)."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="ckptflow-save", daemon=False).start()
    return future


def _wait_for(future: Future[Any], timeout: float | None, version: int) -> Any:
    """``future``'s result within ``timeout``; if this thread is interrupted meanwhile (a worker's
    SIGTERM), the save still finishes, and commits, before the interruption goes on."""
    try:
        return future.result(timeout)
    except TimeoutError:
        if future.done():
            raise  # the save's own error
        raise SaveTimeoutError(
            f"the save of version {version} did not commit within {timeout:g}s (save_timeout_seconds); "
            "its write goes on, and the next attempt waits for it"
        ) from None
    except BaseException:
        wait_futures([future])
        if future.exception() is not None:
            raise future.exception() from None  # type: ignore[misc]
        raise


__all__ = [
    "RUN_FILE",
    "ConfigMismatchError",
    "EpochTries",
    "SaveResult",
    "SaveTimeoutError",
    "TrainingRun",
    "commit_checkpoint",
    "finalize",
    "init_model",
    "save_checkpoint",
    "train_epoch",
]
