"""A stop that the flow handles reads as a stop in the run's logs, not as a crash.

A cancellation (the UI's Cancel, a worker's SIGTERM, Kubernetes, a spot
notice) is a stop the training flow plans for: the step in progress ends, the
run saves where it stands, the saves in flight commit, and the run ends
Cancelled with its summary. Prefect's engine does not know that, and logs
it as errors:

- SIGTERM raises ``TerminationSignal`` in the task in progress, which Prefect
  logs as "Crash detected! Execution was aborted by Python signal" and
  "Finished in state Crashed(...)", both at ERROR, and leaves the task run
  Crashed;
- a flow run that returns its Cancelled state under a worker ends with
  "Engine execution exited with unexpected exception" and the traceback of
  ``CancelledRun`` (the engine asks the Cancelled state for its result), at
  ERROR after the INFO line "Finished in state Cancelled(...)" that says it all.

A user reads "the cancel failed". So, for a flow run marked here as stopping
(:func:`stopping`, from the SIGTERM handler of :func:`noting_sigterm` or the
flow's cancel watch) or as ended Cancelled (:func:`ended_cancelled`), a filter
on Prefect's run loggers turns exactly those lines into INFO lines that say
what happened, and drops the ``CancelledRun`` traceback; the flow sets the
task run it stopped Cancelled (:func:`cancel_stopped_task_runs`). Every other
error of such a run stays an error, and other runs are not touched.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any
from uuid import UUID

log = logging.getLogger(__name__)

_lock = threading.Lock()
_stopping: dict[str, str] = {}  # flow run id -> why it stops ("SIGTERM", "a cancellation from Prefect")
_ended: set[str] = set()  # flow run ids that returned their Cancelled state


def stopping(flow_run_id: str | UUID | None, why: str) -> None:
    """The flow run ``flow_run_id`` is being stopped by the flow itself (``why``: what told it)."""
    if flow_run_id is not None:
        _install()
        with _lock:
            _stopping.setdefault(str(flow_run_id), why)


def ended_cancelled(flow_run_id: str | UUID | None) -> None:
    """The flow run returns its Cancelled state: Prefect's ``CancelledRun`` traceback is not an error."""
    if flow_run_id is not None:
        _install()
        with _lock:
            _ended.add(str(flow_run_id))


@contextlib.contextmanager
def noting_sigterm(flow_run_id: str | None) -> Iterator[None]:
    """While the flow runs (in the main thread): a SIGTERM marks the run as stopping before the
    handler it replaced (Prefect's, which raises ``TerminationSignal``) is called as before."""
    if flow_run_id is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def note(signum: int, frame: Any) -> None:
        stopping(flow_run_id, "SIGTERM")
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:  # no handler of Prefect's: the default action
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, note)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is note:
            signal.signal(signal.SIGTERM, previous)


def cancel_stopped_task_runs(flow_run_id: str | UUID | None, message: str) -> list[str]:
    """Set Cancelled the task runs of ``flow_run_id`` that the stop left Crashed (the epoch that
    SIGTERM interrupted, whose step the run then saved); returns their names. Never raises."""
    if flow_run_id is None:
        return []
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled

    from .prefect_runs import prefect_client

    names = []
    try:
        with prefect_client() as client:
            for task_run in client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(flow_run_id))])),
                task_run_filter=TaskRunFilter(
                    state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.CRASHED]))
                ),
            ):
                client.set_task_run_state(task_run.id, Cancelled(message=message), force=True)
                names.append(task_run.name)
    except Exception as exc:
        log.warning("could not mark the stopped task runs Cancelled: %s", exc)
    return names


class _CleanStopFilter(logging.Filter):
    """Rewrites Prefect's error lines about a stop the flow handles (see the module's text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        run_id = str(getattr(record, "flow_run_id", "") or "")
        with _lock:
            why, ended = _stopping.get(run_id), run_id in _ended
        message = str(record.msg)
        if ended and record.exc_info and type(record.exc_info[1]).__name__ == "CancelledRun":
            return False  # "Finished in state Cancelled(...)", logged at INFO just before, says it
        if why is None or getattr(record, "task_run_id", None) is None:
            return True
        if message.startswith("Crash detected!"):
            _downgrade(record, f"stopped by {why}: the run saves where it stands, then ends Cancelled")
        elif message.startswith("Finished in state"):  # Crashed; Running where Prefect could not set it
            _downgrade(record, f"ended by the run's stop ({why}); marked Cancelled once the run has saved")
        return True


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
