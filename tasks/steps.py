"""The pipeline's Prefect tasks: init, train an epoch, save, commit, finalize.

Each task is a thin wrapper over ``ckptflow.storage`` and the user's spec, and
each is safe to retry:

- ``init_model`` builds everything from scratch on every attempt.
- ``train_epoch`` restores the state captured at the start of the epoch
  before a retried attempt, so a retry never continues a half-updated model.
  It also puts back the RNG states the previous epoch ended with, and the
  checkpoint saves those: the process's global RNGs are shared with Prefect
  (retry jitter draws from ``random`` in the flow's thread), and draws made
  between epochs must not reach training. Draws by other threads *during* an
  epoch cannot be kept out (Prefect's events client pings its websocket with
  ``random.getrandbits``): a spec that needs a bitwise resume should not draw
  from Python's global ``random``.
- ``save_checkpoint`` writes version number = epoch: a retry after a crash
  clears the leftovers and writes the same version again, and a retry after
  the commit finds the version committed and returns it, so one epoch yields
  one committed version, never two.
- ``commit_checkpoint`` waits for an async save and, if the background write
  failed, writes the same staged state again on the next attempt.

With ``train_process`` the spec's objects live in a training process
(:mod:`.trainer`): these tasks send it their work and wait for its answers,
with the same retry and timeout rules; the work itself is the same code
(:mod:`.run_state`).

A save runs in a helper thread and the task waits for it even when the run is
being cancelled (Prefect raises ``TerminationSignal`` in the main thread): the
save in progress finishes and commits, and nothing half-written is exposed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
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
    SaveHandle,
    StateMismatchError,
    StoreLockedError,
    VersionInfo,
)

from . import run_state
from .config import PipelineConfig, RetentionConfig
from .formatting import retention_line
from .monitoring import notify
from .retrying import failure_key, io_task, is_transient, refuse_retries, unless_refused
from .run_state import RUN_FILE, ConfigMismatchError, EpochAttempts, NothingToResumeError, RunState
from .spec import SpecError
from .trainer import TrainerDiedError


class SaveTimeoutError(TimeoutError):
    """A save did not commit within ``save_timeout_seconds``; its write goes on, and a retry waits for it."""


def open_store(config: PipelineConfig) -> CheckpointStore:
    return run_state.open_store(config)


def check_run_identity(store: CheckpointStore, config: PipelineConfig) -> None:
    """Compare the config with ``run.json`` beside the checkpoints (the ranks' rank 0 writes it
    once they are built and restored)."""
    run_state.check_run_identity(store, config, get_run_logger().warning)


def _may_pass(task: Any, task_run: Any, state: Any) -> bool:
    """Retry init unless it failed on something only the user can change (config, spec path, a
    model that no longer fits the checkpoint)."""
    error = state.result(raise_on_failure=False)
    return not isinstance(error, (ConfigMismatchError, NothingToResumeError, SpecError, StateMismatchError))


@io_task("init_model", retries=2, retry_condition_fn=_may_pass)
def init_model(config: PipelineConfig) -> RunState:
    """Build the spec's objects; restore the newest committed checkpoint if there is one.

    With ``train_process``, the training process builds them (see :mod:`.trainer`).
    """
    logger = get_run_logger()
    if config.uses_trainers:
        return _init_remote(config, logger)
    return run_state.build_run(config, open_store(config), info=logger.info, warn=logger.warning)


def _init_remote(config: PipelineConfig, logger: Any) -> RunState:
    from .trainer import take

    process, prestarted = take(config)
    process.set_log(_log_to(logger))  # what the build noted (resuming from, config changes)
    try:
        built = process.built().result()
        if prestarted:  # built before this flow held the store: another run may have committed since
            process, built = _built_from_the_newest(config, process, built, logger)
    except BaseException:
        process.close(interrupted=True)
        raise
    _tell_flow_run(process)
    world = built.get("world_size", 1)
    logger.info(
        "training in %s (launcher pid %d%s), torch intra-op threads: %d of %d cores",
        f"{world} ranks" if world > 1 else "a training process",
        process.pid,
        ", started before Prefect" if prestarted else "",
        built["threads"],
        os.cpu_count() or 1,
    )
    store = open_store(config)
    run_state.claim_store(store, built.get("identity"), logger.warning)  # this flow holds the lease now
    resumed = built["resumed_from"]
    return RunState(
        config,
        store,
        None,
        None,
        epoch=built["epoch"],
        step=built["step"],
        resumed_from=VersionInfo(**resumed) if resumed is not None else None,
        metrics={int(k): v for k, v in built["metrics"].items()},
        remote=process,
        planned_epochs=built["planned_epochs"],
    )


def _built_from_the_newest(
    config: PipelineConfig, process: Any, built: dict[str, Any], logger: Any
) -> tuple[Any, dict[str, Any]]:
    """The trainers and their build, restored from the store's newest version now that this flow
    holds the lease: trainers that restored an older one (another run committed in between) are
    replaced, so that a run never continues from a version that is no longer the newest."""
    from .trainer import relaunch

    latest = open_store(config).latest()
    restored = built["resumed_from"]["version"] if built["resumed_from"] is not None else None
    if (latest.version if latest is not None else None) == restored:
        return process, built
    logger.warning(
        "the training process restored %s before this run held the store, and another run has "
        "committed since (newest: %s): building it again from the newest",
        f"version {restored}" if restored is not None else "nothing",
        latest.url if latest is not None else "none",
    )
    options = process.storage_options
    process.close(interrupted=True)
    process = relaunch(config, options)
    process.set_log(_log_to(logger))
    try:
        return process, process.built().result()
    except BaseException:
        process.close(interrupted=True)
        raise


def _tell_flow_run(process: Any) -> None:
    run_id = flow_run.get_id()
    if run_id is not None:  # for the spec's own logging
        process.call("flow_run", id=str(run_id)).result()


def _live_trainers(run: RunState) -> bool:
    """Make sure the run's trainers are alive; True if new ones had to be started.

    Trainers that died (a rank failed or was killed) are replaced by new ones, which resume from
    the last commit; the epochs trained since then are trained again, so that the new trainers
    stand where the flow's run stands (``run.epoch``). Training is deterministic from a commit
    (its RNG states are saved), so they stand exactly there. An epoch among them whose save
    died with the old trainers (an async save in flight) is saved again, as the same version.
    """
    from .trainer import relaunch

    old = run.remote
    if not old.dead():
        return False
    logger = get_run_logger()
    logger.warning("%s: starting new trainers", old.died_message())
    process = relaunch(run.config, old.storage_options)
    process.set_log(_log_to(logger))
    try:
        built = process.built().result()
        _tell_flow_run(process)
        if built["epoch"] > run.epoch:
            raise RuntimeError(
                f"the new trainers resumed at epoch {built['epoch']}, after the run's epoch {run.epoch}"
            )
        log = _log_to(logger)
        for epoch in range(built["epoch"] + 1, run.epoch + 1):
            logger.info("training epoch %d again: its trainers died before it was committed", epoch)
            process.call("train", log, epoch=epoch, keep_snapshot=False).result()
            if epoch % run.config.save_every == 0 and run.store.find(epoch) is None:
                # its save died with the old trainers: the flow's wait for it finds this commit
                logger.info("saving epoch %d again: its save died with the trainers", epoch)
                process.call("save", log, epoch=epoch, **{"async": False}).result()
    except BaseException:
        process.close(interrupted=True)
        raise
    run.remote = process
    return True


@task(name="train_epoch", cache_policy=NO_CACHE, retry_condition_fn=unless_refused)
def train_epoch(run: RunState, epoch: int, attempts: EpochAttempts) -> dict[str, float]:
    """Run the spec's epoch (and evaluation); return finite float metrics.

    With trainers, a retry after they died starts new ones from the last commit (see
    :func:`_live_trainers`); a retry after an error in the epoch restores the epoch's start state.
    An error that repeats the previous attempt's exactly is not retried (see :mod:`.retrying`).
    """
    attempts.count += 1
    try:
        return _train_attempt(run, epoch, attempts)
    except Exception as exc:
        if isinstance(exc, TrainerDiedError):  # a process that died is not a failure of the epoch's code
            attempts.failure = None
            raise
        key = failure_key(exc)
        if key == attempts.failure and not is_transient(exc):
            why = (
                f"epoch {epoch} failed as its previous attempt did ({key[0]} at {os.path.basename(key[2])}): "
                "not retried, since a retry replays the epoch from the same state"
            )
            get_run_logger().warning(why)
            refuse_retries(exc, why)
        attempts.failure = key
        raise


def _train_attempt(run: RunState, epoch: int, attempts: EpochAttempts) -> dict[str, float]:
    warn = get_run_logger().warning
    if run.remote is None:
        return run_state.train_attempt(run, epoch, attempts, warn)
    _live_trainers(run)  # new trainers count their own attempts: their first keeps the start state
    log = _log_to(get_run_logger())
    answer = run.remote.call("train", log, epoch=epoch, keep_snapshot=attempts.keep_snapshot).result()
    run.epoch, run.step = epoch, answer["step"]
    run.metrics[epoch] = answer["metrics"]
    return cast(dict[str, float], answer["metrics"])


def _log_to(logger: Any) -> Callable[[str, str], None]:
    """Notes of the training process, to ``logger`` (a task's run logger: they show on that task)."""
    return lambda level, message: getattr(logger, level)(message)


@dataclass(frozen=True)
class SaveResult:
    """What ``save_checkpoint`` did: the new save (committed, or a handle) and the previous save's commit."""

    saved: VersionInfo | SaveHandle
    previous: VersionInfo | None = None


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


@io_task("save_checkpoint", retry_condition_fn=_save_may_pass)
def save_checkpoint(
    run: RunState,
    epoch: int,
    *,
    async_save: bool,
    previous: SaveHandle | None = None,
    timeout: float | None = None,
) -> SaveResult:
    """Commit the async save in flight, then save the state after ``epoch`` as version ``epoch``.

    Async saves return once the state is copied. Waiting for ``previous`` here, not in a task of
    its own, saves a task run per epoch; if its background write failed, it is written again
    from its staged bytes on the next attempt, before anything else.

    ``timeout`` bounds each wait for a commit (SaveTimeoutError). A write is never started
    twice: a write that outlived its attempt goes on, and the next attempt waits for it.
    """
    committed = _commit_within(previous, timeout) if previous is not None else None
    if run.writing is not None and run.writing[0] == epoch:
        earlier = run.writing[1]
        try:
            info = _wait_for(earlier, timeout, epoch)
        except SaveTimeoutError:
            raise
        except Exception as exc:  # that write failed: write again below
            get_run_logger().warning("the earlier save of version %d failed (%s): saving again", epoch, exc)
        else:
            return SaveResult(info, committed)
        finally:
            if earlier.done():
                run.writing = None
    existing = run.store.find(epoch)
    if existing is not None:
        if not run.store.committed_by_this_writer(epoch):  # never report another writer's version as ours
            raise ForeignVersionError(
                f"version {epoch} of {run.store.url} was committed by another writer, not by this run "
                f"(its manifest carries another lease): epoch {epoch} was not saved. Nothing was "
                "overwritten; see `ckptflow show` for what it holds, remove it if it is not wanted "
                "(`ckptflow prune`), and run again"
            )
        get_run_logger().info("epoch %d is already committed as %s", epoch, existing.url)
        return SaveResult(existing, committed)
    if run.remote is not None:
        _live_trainers(run)
        return _save_remote(run, epoch, async_save, timeout, committed)
    state = run_state.capture_run(run, get_run_logger().warning)
    kwargs = run_state.save_options(run, epoch)
    if async_save:
        return SaveResult(run.store.save_async(state, **kwargs), committed)
    future = _in_thread(lambda: run.store.save(state, **kwargs))
    run.writing = (epoch, future)
    info = _wait_for(future, timeout, epoch)
    run.writing = None
    return SaveResult(info, committed)


def _save_remote(
    run: RunState, epoch: int, async_save: bool, timeout: float | None, committed: VersionInfo | None
) -> SaveResult:
    """``save_checkpoint`` with a training process: it captures and writes the state itself."""
    from .trainer import RemoteSave

    if async_save:
        log = _log_to(get_run_logger())  # its notes (a generator it does not save) show on this task
        version = run.remote.call("save", log, epoch=epoch, **{"async": True}).result()
        return SaveResult(cast(SaveHandle, RemoteSave(run.remote, version, run.store)), committed)
    answer = run.remote.call("save", _log_to(get_run_logger()), epoch=epoch, **{"async": False})
    future: Future[Any] = Future()
    answer.add_done_callback(lambda f: _chain(f, future))
    run.writing = (epoch, future)
    info = _wait_for(future, timeout, epoch)
    run.writing = None
    return SaveResult(info, committed)


def _chain(answer: Future[Any], future: Future[Any]) -> None:
    """``future`` gets ``answer``'s result as a VersionInfo, or its error."""
    error = answer.exception()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(VersionInfo(**answer.result()))


@io_task("commit_checkpoint")
def commit_checkpoint(handle: SaveHandle, timeout: float | None = None) -> VersionInfo | None:
    """Wait until an async save is committed; a failed write is redone on the next attempt.

    None: the trainers that were writing it died first (it is not committed; see :func:`_live_trainers`).
    """
    return _commit_within(handle, timeout)


def _commit_within(handle: SaveHandle, timeout: float | None) -> VersionInfo | None:
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
def finalize(store: CheckpointStore, policy: RetentionConfig) -> list[int]:
    """Apply the retention policy, say what it kept and removed; return the versions it removed."""
    store.wait()
    if not policy.enabled():
        return []
    plan = store.apply_retention(policy.policy())
    line = retention_line(policy, plan)
    get_run_logger().info(line)
    notify("retention", {"text": line, "removed": list(plan.remove), "kept": list(plan.remaining)})
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
    "EpochAttempts",
    "RunState",
    "SaveResult",
    "SaveTimeoutError",
    "commit_checkpoint",
    "finalize",
    "init_model",
    "save_checkpoint",
    "train_epoch",
]
