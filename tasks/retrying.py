"""How ckptflow's tasks retry: exponential backoff with jitter, no result caching, and no retry
of a failure a retry cannot fix.

Caching stays off: task inputs are live training objects (a store, a model),
which Prefect must neither hash nor persist.

An epoch's retry replays the epoch from the state it started with, RNGs
included, so a failure in the spec's own code that repeats the previous
attempt's exactly (:func:`failure_key`: the same type, message and raising
line) will repeat again: it is marked (:func:`refuse_retries`) and
:func:`unless_refused` ends the task instead of spending the other retries.
A failure that differs (a lost connection, a killed rank) is retried as before.
"""

from __future__ import annotations

import traceback
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from .training.compat import add_note

_REFUSED = "ckptflow_not_retried"  # the attribute that marks an exception no retry can fix


def io_task(name: str, *, retries: int = 3, backoff: float = 1.0, **options: Any) -> Any:
    """``@task`` for an idempotent I/O step: ``retries`` with backoff ``backoff * 2**n`` s and 50% jitter."""
    return task(
        name=name,
        cache_policy=NO_CACHE,
        retries=retries,
        retry_delay_seconds=exponential_backoff(backoff),
        retry_jitter_factor=0.5,
        **options,
    )


def failure_key(exc: BaseException) -> tuple[str, str, str]:
    """What makes two failures the same: the error's type, its message and the line that raised it
    (in the training process, for an error raised there)."""
    from .training.protocol import origin

    raised = origin(exc)
    if raised is not None:
        return raised[0], str(exc), raised[1]
    frames = traceback.extract_tb(exc.__traceback__)
    place = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return type(exc).__name__, str(exc), place


TRANSIENT = (OSError, TimeoutError, ConnectionError)  # a data loader's network or disk: may pass


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` may pass on its own however often it repeats (I/O of the epoch's data), so
    that a repetition does not end the retries."""
    from .training.protocol import TrainerError

    if isinstance(exc, TrainerError) and exc.kind:
        import builtins

        kind = getattr(builtins, exc.kind, None)
        return isinstance(kind, type) and issubclass(kind, TRANSIENT)
    return isinstance(exc, TRANSIENT)


def refuse_retries(exc: BaseException, why: str) -> None:
    """Mark ``exc`` as a failure no retry can fix (:func:`unless_refused` ends its task), saying why."""
    setattr(exc, _REFUSED, why)
    add_note(exc, why)


def unless_refused(task: Any, task_run: Any, state: Any) -> bool:
    """A task's ``retry_condition_fn``: retry, unless the failure was marked by :func:`refuse_retries`."""
    return getattr(state.result(raise_on_failure=False), _REFUSED, None) is None
