"""The training pipeline flow: init, then epochs with saves, then exit.

    init ─► ┌─ train epoch (or its steps to a save point) ─► save (async) ─► commit ─┐ ─► finalize
            └──────────────────────── until a stop condition ◄────────────────────────┘

Resume is the default: ``init_model`` restores the newest committed
checkpoint and the loop continues where it stood: the epoch after it, or,
inside an epoch, the step after it. Save points are epoch ends
(``save_every``) and, for a spec that trains by steps (``train_steps``), every
``save_every_steps`` steps and every ``save_every_minutes`` inside epochs; each
stretch of training up to one is a ``train_epoch`` task run, each save a
``save_checkpoint`` task run. Saves overlap the training that follows (async)
unless ``async_save`` is off; each is committed before the next save starts
and before the flow exits, and the retention policy is applied as the run
goes, before each save.

Stopping: the epoch budget, the stop conditions of the config, or a
cancellation. A cancellation from Prefect seen by the flow (the UI's "Cancel"
on a local run) stops a spec's ``train_steps`` after the step in progress (a
``train_epoch`` spec: after the epoch), saves it, and ends the run Cancelled.
SIGTERM (a worker's cancellation, Kubernetes, a spot notice) does the same from
inside the process: the step in progress finishes, the trainer saves it within
``stop_grace_seconds``, the saves in flight commit, and the run ends Cancelled;
the next run resumes from that step. Ctrl-C stops the training processes the
same way (an in-process step it cuts short is not saved) and ends Interrupted.

The model trains in the flow's process (``train_process`` off: for a
debugger) or in trainers: a torch.distributed world of ``nproc`` ranks per
machine (one is the plain case; ``nnodes`` machines), launched by torch's
elastic launcher (``ckptflow.tasks.training.trainer``). ``init_model`` decides which,
once; the same loop and the same tasks drive either through one trainer
protocol (``ckptflow.tasks.training.protocol``): one ``train_epoch`` task run per epoch
at every world size, and where the run stands is the trainer's last answer.
Every rank writes its share of each checkpoint and rank 0 commits; this
process archives, uploads and applies retention. A rank that dies fails the
task in progress; its retry starts new trainers, which resume from the last
commit. An interrupted flow stops them after the save in flight commits.

Every run labels its flow run with the process that runs it and marks
Crashed the training runs of this host whose process is gone (a SIGKILL
leaves them Running; see ``ckptflow.tasks.reporting.crashed``).

One run per store: the flow holds the store's writer lease (``lease.json``,
see ``ckptflow.storage.versions.lease``) from before init builds or writes anything
until it ends, however it ends; a second run on the store is refused with
the holder named, and a killed run's lease is taken over after
``lease_timeout_seconds`` (at once on its own host).

Deployment entrypoint: ``flows/train.py:train_pipeline``.
"""

from __future__ import annotations

import contextlib
import contextvars
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Cancelled, Failed, State
from prefect.utilities.annotations import quote

from ckptflow.storage import CheckpointStore, Fetched, StoreLease, VersionInfo, redact
from ckptflow.tasks.archiving import ArchiveQueue, durable_holds_versions, fetch_from_durable, fetched_json
from ckptflow.tasks.cadence import Cadence
from ckptflow.tasks.config import PipelineConfig
from ckptflow.tasks.reporting.clean_stop import cancel_stopped_task_runs, ended_cancelled, handling_stops
from ckptflow.tasks.reporting.crashed import record_this_run
from ckptflow.tasks.reporting.formatting import metrics_text
from ckptflow.tasks.reporting.monitoring import RunMonitor, step_text
from ckptflow.tasks.steps import (
    EpochTries,
    TrainingRun,
    commit_checkpoint,
    finalize,
    init_model,
    open_store,
    save_checkpoint,
    train_epoch,
)
from ckptflow.tasks.stopping import CANCELLED, SIGTERM_STOP, StopTracker, note_stop_signal
from ckptflow.tasks.training.protocol import PendingSave
from ckptflow.tasks.training.run_state import nothing_to_resume

# What a stopping run waits for each of its own Prefect API calls (the wording of its end, the
# stopped task runs, its summary): after SIGTERM the process must leave within the grace period,
# and a busy server answers one call in minutes (Prefect's own final state still waits for it).
STOP_API_SECONDS = 10.0


@flow(name="ckptflow-train", validate_parameters=True)
def train_pipeline(config: PipelineConfig) -> dict[str, Any] | State:
    """Train with checkpoints; resume from the newest committed one."""
    record_this_run(_store_name(config))  # and mark Crashed the runs on this host whose process is gone
    handling_stops(flow_run.get_id())  # Prefect's error lines about its stops read as what they are
    with _writer_lease(config) as (store, lease):
        return _train(config, store, lease)


def _store_name(config: PipelineConfig) -> str | None:
    """The store's one name (``CheckpointStore.canonical_url``), recorded on the run: a relative
    path resolved here, in the directory the run started in."""
    try:
        return CheckpointStore(config.storage).canonical_url
    except Exception:  # the store's own open says what is wrong with the URL
        return None


@contextlib.contextmanager
def _writer_lease(config: PipelineConfig) -> Iterator[tuple[CheckpointStore, StoreLease]]:
    """Hold the store's writer lease for the whole run, before anything is built or written;
    yields the store and its lease.

    A second run on the same store is refused (StoreLockedError names the holder); the lease
    is released when the flow ends, however it ends. The training process and the ranks write
    for this process, which holds the lease for them.
    """
    name = flow_run.get_name() or "local"
    owner = f"ckptflow run (flow run {name}, {flow_run.get_id() or 'no id'})"
    store = open_store(config)
    if config.resume_only and store.latest() is None and not durable_holds_versions(config.archive):
        raise nothing_to_resume(store.url)  # before the lease creates anything there
    with store.lease(owner=owner, timeout=config.lease_timeout_seconds) as lease:
        if lease.took_over is not None:  # in the run's own log, not only on its process's console
            get_run_logger().warning("%s", lease.took_over)
        get_run_logger().info("holding the writer lease %s (timeout %gs)", lease.url, lease.info.timeout)
        yield store, lease


def _train(config: PipelineConfig, store: CheckpointStore, lease: StoreLease) -> dict[str, Any] | State:
    """The run; whatever ends it, its summary says how and where it stands."""
    monitor = RunMonitor(
        run_name=flow_run.get_name() or "local",
        store_url=store.url,
        total_epochs=config.epochs,
        best_by=_best_by(config),
        given=redact(config.storage),
        world_size=config.nproc * config.nnodes,
        run_id=flow_run.get_id(),
    )
    reached = Reached(fetched=fetch_from_durable(store, config))
    try:
        return _run_epochs(config, lease, monitor, reached)
    except BaseException as exc:
        run = reached.run
        state, why = _how_it_ended(exc, reached.in_flight, monitor)
        latest, unreadable = _latest(run.store if run is not None else store, monitor)
        epochs = _trained(run, latest) if run is not None else "none (init did not finish)"
        monitor.ended(state, why, latest, rows=[("epochs", epochs)], unreadable=unreadable)
        raise


def _best_by(config: PipelineConfig) -> tuple[str, str] | None:
    """Which metric says the best checkpoint, and its direction: the stop conditions' metric, else
    the one retention keeps the best by; None when the run names neither."""
    if config.stop.metric:
        return config.stop.metric, config.stop.mode
    if config.retention.keep_best and config.retention.best_mode:
        return config.retention.keep_best, config.retention.best_mode
    return None


@dataclass
class Reached:
    """What a run got to, for the summary of a run that ends otherwise than by a stop condition."""

    run: TrainingRun | None = None  # once init has built it
    in_flight: int | None = None  # the version whose async save was in flight when it was interrupted
    fetched: Fetched | None = None  # the version brought back from the durable tier before init


def _run_epochs(
    config: PipelineConfig, lease: StoreLease, monitor: RunMonitor, reached: Reached
) -> dict[str, Any] | State:
    """Init, then epochs, saves and commits until a stop condition."""
    logger = get_run_logger()
    run = reached.run = init_model(config)
    run.store.write_under(lease)  # a commit after the lease was lost fails
    existing = run.store.versions()
    fetched = fetched_json(reached.fetched)
    monitor.start(existing, first_epoch=run.first_epoch, resumed=run.resumed_from, fetched=fetched)
    stopper = StopTracker(config.stop, config.epochs)
    cadence = Cadence.of(config)
    stopper.seed(run.metrics)
    reason = f"already at epoch {run.epoch}" if run.epoch >= config.epochs else None
    pending: PendingSave | None = None
    archiver = ArchiveQueue(
        run.store, config.archive, existing, on_result=monitor.archived, on_durable=monitor.durable
    )
    train = train_epoch.with_options(retries=config.epoch_retries)
    save = save_checkpoint.with_options(retries=config.save_retries)
    watch = CancelWatch(on_cancel=run.trainer.request_stop)
    removed_early: tuple[int, ...] = ()  # what retention removed before the saves
    try:
        archiver.catch_up()  # versions an interrupted run committed but did not archive
        while reason is None:
            epoch = run.epoch + 1
            tries = EpochTries(keep_snapshot=config.epoch_retries > 0)
            trained = train(_opaque(run), epoch, _opaque(tries))
            stopped = CANCELLED if trained.stopped or watch.requested else None
            if trained.metrics is not None:  # the epoch's end
                monitor.epoch_done(epoch, trained.metrics)
                logger.info(
                    "epoch %d/%d: %s%s", epoch, config.epochs, metrics_text(trained.metrics), _status(monitor)
                )
                reason = stopper.update(epoch, trained.metrics) or stopped
                due = cadence.epoch_end_due(epoch, stopping=reason is not None, inside=trained.due)
            else:  # a save point, or a stop, inside the epoch
                progress = run.progress
                where = step_text(progress.in_epoch, progress.epoch_steps)
                monitor.step_done(epoch, progress.in_epoch, progress.epoch_steps)
                logger.info(
                    "epoch %d/%d, %s (step %d in all)%s",
                    epoch,
                    config.epochs,
                    where,
                    progress.step,
                    _status(monitor),
                )
                reason, due = stopped, True
            if due:
                lease.check()  # a run that lost the store (its lease taken over) saves nothing more
                version = run.version_for_save()
                result = save(
                    _opaque(run),
                    version,
                    previous=_opaque(pending),
                    timeout=config.save_timeout_seconds,
                    retention=config.retention if config.retention.enabled() and archiver.idle() else None,
                    durable_from=archiver.not_durable_from(),
                )
                run.next_version = version + 1
                removed_early += result.removed
                pending = None
                if result.previous is not None:
                    _committed(result.previous, monitor, archiver)
                if isinstance(result.saved, VersionInfo):
                    _committed(result.saved, monitor, archiver)
                else:  # an async save in flight: reported the moment it commits
                    pending = result.saved
                    pending.on_commit(monitor.committed)
        lease.check()
        _commit(pending, monitor, config, archiver)
        run.close()
    except BaseException as exc:
        # the trainer's saves in flight commit before it stops, in an interrupted run too; told to
        # stop (SIGTERM, Ctrl-C), it saves where it stands first...
        preempted = _told_to_stop(exc)
        bound = config.archive.stop_drain_seconds if preempted else None
        _quietly("abandon the archive jobs", lambda: archiver.abandon(timeout=bound))
        reached.in_flight = pending.version if pending is not None else None
        _quietly("close the run", lambda: run.close(interrupted=True, preempted=preempted))
        in_flight = reached.in_flight if preempted else None
        monitor.catch_up(run.store.versions, in_flight=in_flight)  # ...and what committed is reported
        if preempted and not isinstance(exc, KeyboardInterrupt):  # SIGTERM ends the run Cancelled
            return _stopped_by_signal(exc, run, monitor, reached, archiver)
        raise  # the summary: _train
    finally:
        watch.close()
    archiver.drain(strict=False)  # a failed job is reported by _finish
    durable_removed: list[int] = []
    _quietly(
        "apply the durable tier's retention", lambda: durable_removed.extend(archiver.durable_retention())
    )
    removed = sorted({*removed_early, *finalize(run.store, config.retention, archiver.not_durable_from())})
    resumed_from = run.resumed_from.version if run.resumed_from else None
    ended = _finish(
        run.store,
        monitor,
        run.first_epoch,
        run.epoch,
        resumed_from,
        reason,
        removed,
        archiver,
        reached.fetched,
    )
    if isinstance(ended, dict):  # what a schedule is sized by (RunFacts.planned_epochs), for the hint
        ended["planned_epochs"] = run.planned_epochs
        if config.archive.durable_keep_last is not None:
            ended["durable_pruned"] = durable_removed
    return ended


def _finish(
    store: CheckpointStore,
    monitor: RunMonitor,
    first_epoch: int,
    last_epoch: int,
    resumed_from: int | None,
    reason: str | None,
    removed: list[int],
    archiver: ArchiveQueue,
    fetched: Fetched | None,
) -> dict[str, Any] | State:
    latest, unreadable = _latest(store, monitor)
    summary = _summary(store.url, latest, first_epoch, last_epoch, resumed_from, reason, removed)
    summary["fetched"] = fetched_json(fetched)
    mirror = archiver.mirror_status()
    if mirror is not None:  # every run with an upload target says what the mirror lacks
        summary.update(mirror.as_dict())
        summary["durable_newest"] = archiver.durable_newest if archiver.durable_known else None
        summary["durable_outages"] = list(archiver.outages)
        get_run_logger().info(mirror.line())
        monitor.note(mirror.line())
    get_run_logger().info("stopped: %s; latest checkpoint: %s", reason, summary["latest_url"])
    ending: dict[str, Any] | State = summary
    state, why = "Completed", f"{reason}"
    if reason in (CANCELLED, SIGTERM_STOP):
        why = f"cancelled after committing {_newest_text(latest)}"
        state, ending = "Cancelled", Cancelled(message=why)
        ended_cancelled(flow_run.get_id())
    elif archiver.unresolved():
        why = f"training ended at epoch {last_epoch}, but {archiver.unresolved()[0]}"
        state, ending = "Failed", Failed(message=why)
    resumed = f"resumed from version {resumed_from}" if resumed_from is not None else "a new run"
    if fetched is not None and fetched.version == resumed_from:
        resumed += f", fetched from {fetched.source}"
    rows = [
        ("epochs", f"{_epochs(first_epoch, last_epoch)} ({resumed})"),
        ("pruned versions", ", ".join(map(str, removed)) or "none"),
    ]
    monitor.ended(state, why, latest, rows=rows, removed=removed, unreadable=unreadable)
    return ending


def _told_to_stop(exc: BaseException) -> bool:
    """Whether the flow was told to stop (SIGTERM: a worker's cancellation, Kubernetes, a spot
    notice; Ctrl-C) rather than failed: then the trainer saves where the run stands."""
    from prefect.exceptions import TerminationSignal

    from ckptflow.tasks.training.rank import Preempted

    return isinstance(exc, (TerminationSignal, KeyboardInterrupt, Preempted))


def _stopped_by_signal(
    exc: BaseException, run: TrainingRun, monitor: RunMonitor, reached: Reached, archiver: ArchiveQueue
) -> State:
    """The end of a run told to stop: Cancelled, with what it saved (the summary: as any end), its
    newest version sent to the durable tier first when it has one and the grace allows."""
    note_stop_signal(getattr(exc, "signal", signal.SIGTERM))  # TerminationSignal's, or a trainer's SIGTERM
    latest, unreadable = _latest(run.store, monitor)
    _, why = _how_it_ended(exc, reached.in_flight, monitor)
    saved = f"; newest committed: {_newest_text(latest)}"
    if archiver.config.upload_to is not None:
        _quietly("drain to the durable tier", lambda: archiver.drain_on_stop(latest, list(monitor.versions)))
        saved += "; " + archiver.durable_line()
    message = f"{why}{saved}"
    epochs = _trained(run, latest)
    monitor.ended(
        "Cancelled", message, latest, rows=[("epochs", epochs)], unreadable=unreadable, flush=STOP_API_SECONDS
    )
    get_run_logger().info("stopped: %s", message)
    run_id, note = flow_run.get_id(), f"stopped by the run's stop: {message}"
    for name in _within(STOP_API_SECONDS, lambda: cancel_stopped_task_runs(run_id, note), []):
        get_run_logger().info("task run %s: stopped by SIGTERM, marked Cancelled", name)
    ended_cancelled(flow_run.get_id())
    return Cancelled(message=message)


def _status(monitor: RunMonitor) -> str:
    status = monitor.status()
    return f"; {status}" if status else ""


def _newest_text(latest: VersionInfo | None) -> str:
    """ "epoch 3" (version 3), or "epoch 3, step 1,200/4,000 (version 7)" for a save inside it."""
    if latest is None:
        return "nothing"
    if latest.in_epoch:
        where = step_text(latest.in_epoch, latest.epoch_steps)
        return f"epoch {latest.epoch}, {where} (version {latest.version})"
    same = latest.version == latest.epoch
    return f"epoch {latest.epoch}" + ("" if same else f" (version {latest.version})")


def _latest(store: CheckpointStore, monitor: RunMonitor) -> tuple[VersionInfo | None, str | None]:
    """The store's newest committed version; if the store cannot be read, the newest the run knew
    of, and why it could not be read (the summary then says so, not "none committed")."""
    try:
        return store.latest(), None
    except Exception as exc:
        get_run_logger().warning("could not read the latest checkpoint of %s: %s", store.url, exc)
        known = max(monitor.versions.values(), key=lambda v: v.version, default=None)
        return known, f"{type(exc).__name__}: {exc}"


def _quietly(what: str, step: Any) -> None:
    """One cleanup step of an interrupted run: its failure is logged, and the others still run."""
    try:
        step()
    except Exception as exc:
        get_run_logger().warning("could not %s: %s", what, exc)


def _trained(run: TrainingRun, latest: VersionInfo | None) -> str:
    """The epochs a run that did not end by a stop condition trained, and, where its last commit
    holds less (the epoch in progress, a save that did not commit), what a resume continues after."""
    epochs = _epochs(run.first_epoch, run.epoch)
    if latest is None or latest.epoch != run.epoch or latest.in_epoch:
        epochs += f" (last committed: {_newest_text(latest)}; a resume continues after it)"
    return epochs


def _epochs(first_epoch: int, last_epoch: int) -> str:
    return f"{first_epoch}..{last_epoch}" if last_epoch >= first_epoch else "none trained"


def _how_it_ended(exc: BaseException, in_flight: int | None, monitor: RunMonitor) -> tuple[str, str]:
    """How an exception ends the flow run, and why, for the run's summary."""
    from prefect.exceptions import TerminationSignal

    saved = ""
    if in_flight is not None:
        done = "committed" if in_flight in monitor.versions else "did not commit"
        saved = f"; the save of version {in_flight} that was in flight {done}"
    if isinstance(exc, TerminationSignal):
        if _within(STOP_API_SECONDS, _cancel_requested, False):
            return "Cancelled", f"cancelled from Prefect (the worker's SIGTERM){saved}"
        return "Stopped", f"the process got SIGTERM, not a cancellation from Prefect{saved}"
    if isinstance(exc, KeyboardInterrupt):
        return "Interrupted", f"Ctrl-C{saved}"
    if isinstance(exc, SystemExit):  # its worker gone, say: Prefect records the run Crashed
        return "Crashed", f"the process exited ({type(exc).__name__}: {exc}) before the run ended{saved}"
    return "Failed", f"{type(exc).__name__}: {exc}{saved}"


def _cancel_requested() -> bool:
    """Whether this flow run is Cancelling or Cancelled (False if the API cannot say)."""
    from ckptflow.tasks.reporting.prefect_runs import cancel_requested

    run_id = flow_run.get_id()
    if run_id is None:
        return False
    try:
        return cancel_requested(UUID(run_id))
    except Exception:
        return False


def _within(seconds: float, call: Callable[[], Any], default: Any) -> Any:
    """``call()``'s result if it returns within ``seconds``, else ``default`` (it goes on in a daemon
    thread, in this thread's context: the run's API settings and logger)."""
    box: list[Any] = []
    context = contextvars.copy_context()
    thread = threading.Thread(
        target=context.run, args=(lambda: box.append(call()),), name="ckptflow-stop-call", daemon=True
    )
    thread.start()
    thread.join(seconds)
    return box[0] if box else default


def _opaque(value: Any) -> Any:
    """``value`` for a task argument that Prefect passes on without walking through it.

    Prefect visits every dataclass, model and collection in a task's arguments; a run's state
    (model, optimizer, data) made that cost more than the rest of an epoch's orchestration.
    """
    return quote(value)


def _commit(
    pending: PendingSave | None, monitor: RunMonitor, config: PipelineConfig, archiver: ArchiveQueue
) -> None:
    """Wait until the async save in flight (if any) is committed, and report it."""
    if pending is not None:
        commit = commit_checkpoint.with_options(retries=config.save_retries)
        _committed(commit(pending, timeout=config.save_timeout_seconds), monitor, archiver)


def _committed(info: VersionInfo | None, monitor: RunMonitor, archiver: ArchiveQueue) -> None:
    if info is None:  # lost with the trainers that were writing it (commit_checkpoint warned)
        return
    monitor.committed(info)
    archiver.committed(info)  # queues archive/upload jobs the policy says are due


class CancelWatch:
    """Whether this flow run was asked to cancel (a local run gets no SIGTERM for it).

    A thread reads the run's state once a second, so the epoch loop never waits for the API;
    ``on_cancel`` is called once when it is (the trainer stops after its step).
    """

    def __init__(self, every: float = 1.0, on_cancel: Callable[[], None] | None = None) -> None:
        self.requested = False
        self._on_cancel = on_cancel
        self._every = every
        self._stop = threading.Event()
        run_id = flow_run.get_id()
        if run_id is not None:
            context = contextvars.copy_context()  # the run's Prefect settings (API URL)
            thread = threading.Thread(
                target=context.run,
                args=(self._watch, UUID(run_id)),
                name="ckptflow-cancel-watch",
                daemon=True,
            )
            thread.start()

    def reason(self) -> str | None:
        return CANCELLED if self.requested else None

    def close(self) -> None:
        self._stop.set()

    def _watch(self, run_id: UUID) -> None:
        from ckptflow.tasks.reporting.prefect_runs import cancel_requested

        while not self._stop.wait(self._every):
            try:
                cancelled = cancel_requested(run_id)
            except Exception:
                continue
            if cancelled:
                self.requested = True
                if self._on_cancel is not None:
                    self._on_cancel()
                return


def _summary(
    url: str,
    latest: VersionInfo | None,
    first_epoch: int,
    last_epoch: int,
    resumed_from: int | None,
    reason: str | None,
    removed: list[int],
) -> dict[str, Any]:
    return {
        "storage": url,
        "first_epoch": first_epoch,
        "last_epoch": last_epoch,
        "resumed_from": resumed_from,
        "stop_reason": reason,
        "latest_version": latest.version if latest else None,
        "latest_url": latest.url if latest else None,
        "latest_metrics": latest.metrics if latest else {},
        "latest_size": latest.size if latest else 0,
        "pruned": removed,
    }
