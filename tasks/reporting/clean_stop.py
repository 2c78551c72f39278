"""A stop that the flow handles reads as a stop in the run's logs, not as a crash.

A cancellation (the UI's Cancel, a worker's SIGTERM, Kubernetes, a spot
notice) is a stop the training flow plans for: the step in progress ends, the
run saves where it stands, the saves in flight commit, and the run ends
Cancelled with its summary. Prefect's engine does not know that, and logs
it as errors:

- SIGTERM raises ``TerminationSignal`` in the task in progress, which Prefect
  logs as "Crash detected! Execution was aborted by a termination signal."
  and "Finished in state Crashed(...)", both at ERROR, and leaves the task
  run Crashed;
- a flow run that returns its Cancelled state under a worker ends with
  "Engine execution exited with unexpected exception" and the traceback of
  ``CancelledRun`` (the engine asks the Cancelled state for its result), at
  ERROR after the INFO line "Finished in state Cancelled(...)" that says it all.

A user reads "the cancel failed". So a filter on Prefect's run loggers, for
the flow runs that handle their stops (:func:`handling_stops`), turns exactly
those lines into INFO lines that say what happened: a task's crash by a
termination signal (which also marks the run as stopping), the "Finished in
state" line of such a task, and, for a run that returned its Cancelled state
(:func:`ended_cancelled`), the ``CancelledRun`` traceback, which it drops.
The flow then sets the task runs the stop interrupted Cancelled
(:func:`cancel_stopped_task_runs`). Every other error stays an error, other
runs are not touched, and Prefect's own SIGTERM handler stays in place (its
runner's cancellation handshake needs it).
"""

from __future__ import annotations

import logging
import threading
from uuid import UUID

log = logging.getLogger(__name__)

_lock = threading.RLock()
_handled: set[str] = set()  # flow run ids whose flow handles its stops
_stopping: set[str] = set()  # ...of those, the ones a termination signal is stopping
_ended: set[str] = set()  # flow run ids that returned their Cancelled state
TERMINATED = "Execution was aborted by a termination signal."  # Prefect's message of a SIGTERM crash


def handling_stops(flow_run_id: str | UUID | None) -> None:
    """The flow run ``flow_run_id`` handles its stops (it saves where it stands and ends Cancelled)."""
    if flow_run_id is not None:
        _install()
        with _lock:
            _handled.add(str(flow_run_id))


def ended_cancelled(flow_run_id: str | UUID | None) -> None:
    """The flow run returns its Cancelled state: Prefect's ``CancelledRun`` traceback is not an error."""
    if flow_run_id is not None:
        _install()
        with _lock:
            _ended.add(str(flow_run_id))


def cancel_stopped_task_runs(flow_run_id: str | UUID | None, message: str) -> list[str]:
    """Set Cancelled the task runs of ``flow_run_id`` that the stop left Crashed or open (the epoch
    that SIGTERM interrupted, whose step the run then saved); returns their names. Never raises."""
    if flow_run_id is None:
        return []
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled

    from .prefect_runs import prefect_client, set_task_runs_state

    # Crashed, or still Pending or Running where its Crashed state has not reached the server yet
    # (3.9 sends task states as events): the newer Cancelled state wins either way.
    open_ = [StateType.CRASHED, StateType.RUNNING, StateType.PENDING]
    try:
        with prefect_client() as client:
            run_id = UUID(str(flow_run_id))
            return set_task_runs_state(client, run_id, open_, lambda: Cancelled(message=message))
    except Exception as exc:
        log.warning("could not mark the stopped task runs Cancelled: %s", exc)
        return []


class _CleanStopFilter(logging.Filter):
    """Rewrites Prefect's error lines about a stop the flow handles (see the module's text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        run_id = str(getattr(record, "flow_run_id", "") or "")
        with _lock:
            handled, ended = run_id in _handled, run_id in _ended
        if ended and record.exc_info and type(record.exc_info[1]).__name__ == "CancelledRun":
            return False  # "Finished in state Cancelled(...)", logged at INFO just before, says it
        if not handled or getattr(record, "task_run_id", None) is None:
            return True
        message = record.getMessage()
        if message == f"Crash detected! {TERMINATED}":
            with _lock:
                _stopping.add(run_id)
            _downgrade(record, "stopped by SIGTERM: the run saves where it stands and ends (see its summary)")
        elif _finished_by_the_stop(message, run_id):
            _downgrade(record, "ended by SIGTERM; marked Cancelled once the run has saved")
        return True


def _finished_by_the_stop(message: str, run_id: str) -> bool:
    """A task's "Finished in state" line after SIGTERM: Crashed by it, or Running where Prefect
    could not set its state."""
    if message.startswith("Finished in state Crashed(") and TERMINATED in message:
        return True
    with _lock:
        return message == "Finished in state Running()" and run_id in _stopping


def _downgrade(record: logging.LogRecord, message: str) -> None:
    record.msg, record.args = message, None
    record.levelno, record.levelname = logging.INFO, "INFO"
    record.exc_info, record.exc_text = None, None


_filter = _CleanStopFilter()
LOGGERS = ("prefect.task_runs", "prefect.flow_runs")


def _install() -> None:
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _filter not in logger.filters:
            logger.addFilter(_filter)
