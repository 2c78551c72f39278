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

A save runs in a helper thread and the task waits for it even when the run is
being cancelled (Prefect raises ``TerminationSignal`` in the main thread): the
save in progress finishes and commits, and nothing half-written is exposed.
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from ckptflow.storage import (
    CheckpointStore,
    RankStateWarning,
    SaveHandle,
    StoreOptions,
    VersionInfo,
)

from .config import PipelineConfig, RetentionConfig, identity_differences
from .retrying import io_task
from .spec import SpecError, Trainable, TrainingSpec, load_spec_class
from .training_state import Snapshot, capture, restore, rng_state, run_epoch, seed_everything

RUN_FILE = "run.json"


class ConfigMismatchError(ValueError):
    """A resumed run's spec, spec config or seed differs from the stored run's."""


@dataclass
class RunState:
    """The live objects of one run, shared by the tasks of one flow run (in memory)."""

    config: PipelineConfig
    store: CheckpointStore
    spec: TrainingSpec
    trainable: Trainable
    epoch: int = 0  # last completed epoch
    step: int = 0
    resumed_from: VersionInfo | None = None
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    rng: dict[str, Any] | None = None  # the training RNG states, as the last epoch (or init) left them
    writing: tuple[int, Future[Any]] | None = None  # (version, sync save) that outlived its task's timeout


class SaveTimeoutError(TimeoutError):
    """A save did not commit within ``save_timeout_seconds``; its write goes on, and a retry waits for it."""


def open_store(config: PipelineConfig) -> CheckpointStore:
    return CheckpointStore(
        config.storage,
        storage_options=config.resolved_storage_options(),
        options=StoreOptions(shards=config.shards),
    )


def check_run_identity(store: CheckpointStore, config: PipelineConfig) -> None:
    """Compare the config with ``run.json`` beside the checkpoints; create it on a first run."""
    stored = store.read_json(RUN_FILE)
    current = config.identity()
    if stored is None:
        store.write_json(RUN_FILE, current)
        return
    diffs = identity_differences(stored, current)
    if not diffs:
        return
    if not config.allow_config_change:
        raise ConfigMismatchError(
            f"{store.url} holds a run with a different configuration: {'; '.join(diffs)}. "
            "Resuming would make a different run: use a new storage URL, or set "
            "allow_config_change=true (--allow-config-change) to resume anyway"
        )
    get_run_logger().warning("resuming with a changed configuration: %s", "; ".join(diffs))
    store.write_json(RUN_FILE, current)


def _may_pass(task: Any, task_run: Any, state: Any) -> bool:
    """Retry init unless it failed on something only the user can change (config, spec path)."""
    return not isinstance(state.result(raise_on_failure=False), (ConfigMismatchError, SpecError))


@io_task("init_model", retries=2, retry_condition_fn=_may_pass)
def init_model(config: PipelineConfig) -> RunState:
    """Build the spec's objects; restore the newest committed checkpoint if there is one."""
    logger = get_run_logger()
    store = open_store(config)
    check_run_identity(store, config)
    spec = load_spec_class(config.spec)(config.spec_config, seed=config.seed)
    seed_everything(config.seed)
    run = RunState(config, store, spec, spec.build())
    latest = store.latest()
    if latest is not None:
        into = capture(run.trainable, spec, epoch=0, step=0)  # read the model straight into its tensors
        state = store.load(latest.version, into=into)
        if "rng" not in state:  # saved by several ranks: their own states are apart
            ranks = len(store.manifest(latest.version).ranks)
            logger.warning(
                "version %d was saved by %d ranks: resuming with rank 0's RNG state", latest.version, ranks
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RankStateWarning)
                state.update(store.load_rank_state(latest.version, rank=0, world_size=1) or {})
        run.epoch, run.step = restore(run.trainable, spec, state)
        run.resumed_from = latest
        run.metrics = {v.epoch: v.metrics for v in store.versions() if v.epoch is not None}
        logger.info("resuming from %s (epoch %d)", latest.url, run.epoch)
    else:
        logger.info("starting a new run in %s", store.url)
    run.rng = rng_state()
    return run


class EpochAttempts:
    """Tracks attempts of one epoch; from the second on, the start state is restored first."""

    def __init__(self, run: RunState, *, keep_snapshot: bool) -> None:
        self.snapshot = (
            Snapshot(run.trainable, run.spec, epoch=run.epoch, step=run.step) if keep_snapshot else None
        )
        self.count = 0


@task(name="train_epoch", cache_policy=NO_CACHE)
def train_epoch(run: RunState, epoch: int, attempts: EpochAttempts) -> dict[str, float]:
    """Run the spec's epoch (and evaluation); return finite float metrics."""
    attempts.count += 1
    if attempts.count > 1:
        if attempts.snapshot is None:
            raise RuntimeError(f"epoch {epoch} cannot be retried: no start state was kept")
        run.epoch, run.step = attempts.snapshot.restore(run.trainable, run.spec)
        get_run_logger().warning("retrying epoch %d from its start state (attempt %d)", epoch, attempts.count)
    clean, steps, run.rng = run_epoch(run.spec, run.trainable, epoch, run.rng)
    run.epoch, run.step = epoch, run.step + steps
    run.metrics[epoch] = clean
    return clean


@dataclass(frozen=True)
class SaveResult:
    """What ``save_checkpoint`` did: the new save (committed, or a handle) and the previous save's commit."""

    saved: VersionInfo | SaveHandle
    previous: VersionInfo | None = None


@io_task("save_checkpoint")
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
        get_run_logger().info("epoch %d is already committed as %s", epoch, existing.url)
        return SaveResult(existing, committed)
    state = capture(run.trainable, run.spec, epoch=run.epoch, step=run.step, rng=run.rng)
    kwargs: dict[str, Any] = {
        "epoch": epoch,
        "step": run.step,
        "metrics": run.metrics.get(epoch),
        "version": epoch,
    }
    if async_save:
        return SaveResult(run.store.save_async(state, **kwargs), committed)
    future = _in_thread(lambda: run.store.save(state, **kwargs))
    run.writing = (epoch, future)
    info = _wait_for(future, timeout, epoch)
    run.writing = None
    return SaveResult(info, committed)


@io_task("commit_checkpoint")
def commit_checkpoint(handle: SaveHandle, timeout: float | None = None) -> VersionInfo:
    """Wait until an async save is committed; a failed write is redone on the next attempt."""
    return _commit_within(handle, timeout)


def _commit_within(handle: SaveHandle, timeout: float | None) -> VersionInfo:
    try:
        return _wait_for(_in_thread(handle.wait), timeout, handle.version)
    except SaveTimeoutError:
        raise  # still writing: the next attempt waits again
    except Exception:
        handle.resubmit()
        raise


@task(name="finalize", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=exponential_backoff(1))
def finalize(store: CheckpointStore, policy: RetentionConfig) -> list[int]:
    """Apply the retention policy; return the versions it removed."""
    store.wait()
    if not policy.enabled():
        return []
    removed = store.prune(policy.policy())
    if removed:
        get_run_logger().info("retention removed versions %s", removed)
    return removed


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
