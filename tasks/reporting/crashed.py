"""Training flow runs whose process died: each run records its process, the next run marks them Crashed
and finishes them.

A flow run killed with SIGKILL (or by the OOM killer) never reports a final
state: Prefect shows it Running for good, and maintenance takes its store for
busy. Deployments have the heartbeat automation (``ckptflow setup-server``);
a local ``ckptflow run`` emits no heartbeats. So every training flow run, as
it starts:

1. records the process that runs it, as labels of the flow run:
   ``ckptflow.host`` (host name), ``ckptflow.pid``, ``ckptflow.pid_start``
   (the process's start time, field 22 of ``/proc/PID/stat``, so that a
   reused pid is told apart) and ``ckptflow.pid_space`` (the boot id and the
   pid namespace: another container or another boot has other pids);
2. looks for ``ckptflow-train`` flow runs in Pending, Running or Cancelling
   whose record names this host and pid space and whose process is gone (no
   such pid, or one started at another time), and sets them Crashed with a
   message saying so;
3. finishes the Crashed runs of this host and pid space whose process is
   gone and that have no summary: those it just marked, and those Prefect
   marked first (a worker that saw its child SIGKILLed, the OOM killer's
   case; the heartbeat automation), Crashed within the last
   :data:`FINISH_WITHIN`. Their task runs still Pending or Running (the epoch
   the kill cut short) are set Crashed, their progress shows where the last
   commit stands and no ETA, and each gets the run summary its process could
   not write (:func:`summarize_crashed`: the last committed epoch, where it
   is, how to resume). The summary is written last: a run that has one is
   finished, and never gets a second.
   The maintenance flow does the same for its store's Crashed runs that have
   no summary (those of another host, or of a store this host cannot open):
   :func:`summarize_crashed_runs`.
   This run logs one line per run it marked or finished; Prefect shows the
   line after this run's own name, so the line names the earlier run, when it
   started and its process (:func:`earlier_run_line`).

Why this host's runs, whatever their store, and not the Crashed runs of this
run's store: Crashed is Prefect's word, not proof that the process ended (the
heartbeat automation crashes a run whose machine is only cut off, and its
process may still write its own summary); on this host ``/proc`` proves it.
The runs of other hosts are maintenance's, which writes their summaries later.

What must hold: a run is marked or finished only on proof that its process
is gone. Runs of other hosts or pid spaces (another machine, container or
boot), runs without the record, and this run are never touched. A run with a
summary is never summarized again. Linux only (``/proc``): elsewhere nothing
is recorded and nothing is marked. No step may break a run: an API error is
logged and skipped. The questions to Prefect are
:mod:`.prefect_runs`'s.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any
from uuid import UUID

from ckptflow.storage import CheckpointStore, VersionInfo, current_process, process_ended

from ..config import PipelineConfig
from .artifacts import ArtifactSet, committed_at, ending_markdown, run_key
from .formatting import utc_text
from .monitoring import progress_of
from .prefect_runs import (
    STORE_LABEL,
    active_train_runs,
    crashed_train_runs,
    flow_runs_with_artifacts,
    label_flow_run,
    mark_crashed,
    mark_open_task_runs_crashed,
    newest_artifact_id,
    on_store,
    prefect_client,
    recorded_commit,
    store_url_of,
)

log = logging.getLogger(__name__)

LABELS = ("ckptflow.host", "ckptflow.pid", "ckptflow.pid_start", "ckptflow.pid_space")
FINISH_WITHIN = timedelta(days=1)  # a run start finishes the runs Crashed this recently (maintenance: any)
FINISH_LIMIT = 200  # and looks at this many of them at most
MARKED = "had ended without a final state: marked Crashed"  # what the sweep did, as its line says
FINISHED = "was Crashed without its summary: wrote it and ended its open task runs"


@dataclass(frozen=True)
class ProcessRecord:
    """Which process runs a flow run, precisely enough to tell when it is gone."""

    host: str
    pid: int
    start: str  # clock ticks after boot at which the process started
    space: str  # boot id and pid namespace: the scope in which ``pid`` means this process

    def labels(self) -> dict[str, bool | int | float | str]:  # Prefect's type of flow run labels
        return dict(zip(LABELS, (self.host, str(self.pid), self.start, self.space), strict=True))

    @classmethod
    def from_labels(cls, labels: dict[str, Any]) -> ProcessRecord | None:
        values = [labels.get(key) for key in LABELS]
        if not all(isinstance(v, str) and v for v in values) or not str(values[1]).isdigit():
            return None
        host, pid, start, space = (str(v) for v in values)
        return cls(host, int(pid), start, space)


def this_process() -> ProcessRecord | None:
    """The record of this process; None where ``/proc`` cannot tell (not Linux)."""
    host, pid, start, space = current_process()
    return ProcessRecord(host, pid, start, space) if start and space else None


def is_gone(record: ProcessRecord, here: ProcessRecord) -> bool:
    """Whether ``record``'s process has certainly ended (False when this host cannot tell)."""
    if record.host != here.host or record.space != here.space:
        return False
    if record.pid == here.pid:
        return record.start != here.start
    return process_ended(record.host, record.pid, record.start, record.space)


def record_and_sweep(flow_run_id: UUID, log: Any, store: str | None = None) -> list[str]:
    """Label this flow run with its process and its store's one name (``store``: what
    ``CheckpointStore.canonical_url`` says); mark the gone ones Crashed, and finish this host's
    Crashed runs that have no summary. Returns the names of the runs marked or finished."""
    here = this_process()
    if here is None:
        return []
    try:
        with prefect_client() as client:
            label_flow_run(client, flow_run_id, {**here.labels(), **({STORE_LABEL: store} if store else {})})
            marked = _mark_gone(client, flow_run_id, here)
    except Exception as exc:
        log.warning("could not check for training runs whose process died: %s", exc)
        return []
    for run, record in marked:  # logged by this run: each line must name the earlier run it is about
        log.warning("%s", earlier_run_line(run, record))
    try:
        with prefect_client() as client:
            finished = _finish_crashed(client, flow_run_id, here)
    except Exception as exc:
        log.warning("could not finish the crashed training runs of this host: %s", exc)
        finished = []
    done = {run.id for run, _ in marked}  # each finished too: their line is said
    for run, record in finished:
        if run.id not in done:
            log.warning("%s", earlier_run_line(run, record, FINISHED))
    return [run.name for run, _ in marked] + [run.name for run, _ in finished if run.id not in done]


def earlier_run_line(run: Any, record: ProcessRecord, what: str = MARKED) -> str:
    """``an earlier flow run 'NAME' (started ..., process PID on HOST) had ended without a final
    state: marked Crashed`` (or what else ``what`` says); the line this run logs after its own name."""
    moment = run.start_time or run.created
    started = utc_text(moment)
    return (
        f"an earlier flow run '{run.name}' (started {started}, process {record.pid} on {record.host}) {what}"
    )


def record_this_run(store: str | None = None) -> threading.Thread | None:
    """:func:`record_and_sweep` for the flow run this is called in, in a thread (off the path to
    the first epoch; not a daemon, so a short run still finishes it before its process exits)."""
    from prefect import get_run_logger
    from prefect.runtime import flow_run

    run_id = flow_run.get_id()
    if not run_id:
        return None
    context = contextvars.copy_context()  # the run's Prefect settings (API URL) and logger
    thread = threading.Thread(
        target=context.run,
        args=(record_and_sweep, UUID(run_id), get_run_logger(), store),
        name="ckptflow-crashed-runs",
    )
    thread.start()
    return thread


def _mark_gone(client: Any, flow_run_id: UUID, here: ProcessRecord) -> list[tuple[Any, ProcessRecord]]:
    """Mark Crashed the active runs whose process is gone; return each with its process record."""
    crashed = []
    for run in active_train_runs(client):
        record = ProcessRecord.from_labels(run.labels or {})
        if run.id == flow_run_id or record is None or not is_gone(record, here):
            continue
        message = (
            f"its process (pid {record.pid} on {record.host}) is gone, killed without a final state; "
            f"marked Crashed by flow run {flow_run_id} on the same host"
        )
        mark_crashed(client, run.id, message)
        crashed.append((run, record))
    return crashed


def _finish_crashed(client: Any, flow_run_id: UUID, here: ProcessRecord) -> list[tuple[Any, ProcessRecord]]:
    """Finish (:func:`summarize_crashed`) the runs Crashed within :data:`FINISH_WITHIN` whose
    process, of this host, is gone and that have no summary; return each with its process record."""
    since = datetime.now(timezone.utc) - FINISH_WITHIN
    gone = []
    for run in crashed_train_runs(client, limit=FINISH_LIMIT, ended_after=since):
        record = ProcessRecord.from_labels(run.labels or {})
        if run.id != flow_run_id and record is not None and is_gone(record, here):
            gone.append((run, record))
    if not gone:
        return []
    summarized = flow_runs_with_artifacts(client, [r.id for r, _ in gone], [summary_key(r) for r, _ in gone])
    finished = []
    stores: dict[str | None, list[VersionInfo] | None] = {}
    for run, record in gone:
        if run.id in summarized:
            continue
        url = store_url_of(run)
        if url not in stores:
            stores[url] = _versions_of(url, run.parameters)
        versions = stores[url]
        if versions is None:  # a store this process cannot open: maintenance's
            continue
        try:
            summarize_crashed(client, run, versions, _why(run), _crashed_at(run))
        except Exception as exc:  # the next run or maintenance finishes it; finish the others now
            log.warning("could not finish crashed flow run %s: %s", run.name, exc)
        else:
            finished.append((run, record))
    return finished


def summarize_crashed(
    client: Any, run: Any, versions: list[VersionInfo], why: str, crashed_at: datetime
) -> None:
    """What a Crashed training run's process could not do: end its task runs still Pending or
    Running, show its progress without an ETA, and write its summary (last: a run with one is
    finished). Its last commit comes from its own records (:func:`last_commit_of`), never from what
    is left in the store later."""
    mark_open_task_runs_crashed(client, run.id, "its flow run crashed")
    latest = last_commit_of(run, versions, crashed_at)
    url = store_url_of(run) or "unknown"
    artifacts = ArtifactSet(flow_run_id=run.id)
    total = _total_epochs(run.parameters)
    if total is not None:
        key = f"{run_key(run.name)}-progress"
        progress = newest_artifact_id(client, run.id, key)
        if progress is not None:  # updated in place: the run keeps one progress card
            artifacts.ids[key] = progress
        percent, text = crashed_progress(latest, total, "Crashed")  # a card's one line; the summary says why
        artifacts.progress(key, percent, text)
    text = ending_markdown(state="Crashed", why=why, store_url=url, latest=latest)
    if artifacts.markdown(summary_key(run), text, "ckptflow run summary: Crashed") is None:
        raise RuntimeError(f"the summary of {run.name} could not be written")  # a later run tries again


def last_commit_of(run: Any, versions: list[VersionInfo], crashed_at: datetime) -> VersionInfo | None:
    """A crashed run's last commit, from its own records: the newest of the versions whose manifests
    name it (``lineage.run``) and the one it recorded on itself as it went (which outlives a prune).
    A run that committed nothing: the newest of the store's ``versions`` committed before it crashed
    (where a resume would go on)."""
    own = [v for v in versions if v.lineage.get("run") == str(run.id)]
    recorded = recorded_commit(run)
    if recorded is not None and all(v.version != recorded.version for v in own):
        own.append(recorded)
    if own:
        return max(own, key=lambda v: v.version)
    before = [v for v in versions if committed_at(v) <= crashed_at]
    return max(before, key=lambda v: v.version, default=None)


def crashed_progress(latest: VersionInfo | None, total: int, ending: str) -> tuple[float, str]:
    """A crashed run's progress: the share of ``total`` epochs its last commit ``latest`` holds, and
    ``epoch K/N[, step S/T]; ENDING`` (no ETA: it trains no more)."""
    if latest is None or latest.epoch is None:
        percent, text = progress_of(0, None, total)
    elif latest.in_epoch is not None:  # a save inside epoch K: K - 1 epochs and a share of K
        percent, text = progress_of(
            latest.epoch - 1, (latest.epoch, latest.in_epoch, latest.epoch_steps), total
        )
    else:
        percent, text = progress_of(latest.epoch, None, total)
    return percent, f"{text}; {ending}"


def summarize_crashed_runs(store: CheckpointStore, *, limit: int = 200) -> list[str]:
    """Write the summary of each Crashed training run on ``store`` that has none (a run marked
    Crashed by the heartbeat automation: its process could not write one); returns their names."""
    from prefect import get_run_logger

    with prefect_client() as client:
        runs = on_store(crashed_train_runs(client, limit=limit), store)
        if not runs:
            return []
        summarized = flow_runs_with_artifacts(client, [r.id for r in runs], [summary_key(r) for r in runs])
        missing = [run for run in runs if run.id not in summarized]
        versions = store.versions() if missing else []
        written = []
        for run in missing:
            try:
                summarize_crashed(client, run, versions, _why(run), _crashed_at(run))
            except Exception as exc:
                get_run_logger().warning("could not write the summary of crashed run %s: %s", run.name, exc)
            else:
                written.append(run.name)
    return written


def summary_key(run: Any) -> str:
    """The key of a flow run's summary artifact (:mod:`.monitoring` writes it as the run ends)."""
    return f"{run_key(run.name)}-summary"


def _why(run: Any) -> str:
    """Why a Crashed run crashed: its state's message."""
    return (run.state.message if run.state else None) or "its process ended without a final state"


def _crashed_at(run: Any) -> datetime:
    """When a Crashed run crashed: its state's time."""
    return run.state.timestamp if run.state else datetime.now(timezone.utc)


def _total_epochs(parameters: dict[str, Any]) -> int | None:
    """The epochs a run was to train (its config's ``epochs``); None if its parameters are not a config."""
    try:
        return PipelineConfig.model_validate(parameters["config"]).epochs
    except Exception:
        return None


def _versions_of(url: str | None, parameters: dict[str, Any]) -> list[VersionInfo] | None:
    """The committed versions of a run's store (``url``: its one name, :func:`.prefect_runs.store_url_of`);
    None if this process cannot read it (no name recorded; options in a block it cannot read):
    maintenance, which opens the store with its own options, writes the summary then."""
    if url is None:
        return None
    try:
        config = PipelineConfig.model_validate(parameters["config"])
        return list(CheckpointStore(url, storage_options=config.resolved_storage_options()).versions())
    except Exception:
        return None
