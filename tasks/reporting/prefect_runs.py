"""What ckptflow asks the Prefect API about runs, and what it changes there: one module.

The flow runs of training (those in progress, those that crashed, the store each
one writes), their task runs and labels, a run's state, and what ckptflow
attaches to runs (artifacts; the events of commits). The modules that decide
use these: :mod:`.maintenance` (which stores are busy), :mod:`.crashed` (which
runs are gone, and their summaries), :mod:`.artifacts` and :mod:`.monitoring`
(what a run shows), ``flows/server_cmd.py`` (a client to set a server up). Here
is only how Prefect is asked: the client, the filters, the paging; a query is
named for what it means to ckptflow ("the training runs in progress").

What must hold:

- Prefect is imported inside the functions: modules on the CLI's import path use
  this one, and ``ckptflow ls`` must not pay for importing Prefect.
- A client is opened per use (:func:`prefect_client`, synchronous): the threads of a
  run (the reporter, the crashed-run sweep, the cancel watch) each open their own.
- API errors are the caller's to handle: reporting code logs and skips them, so
  that Prefect never breaks a training run.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from uuid import UUID

from ckptflow.storage import EPOCH_STEPS, IN_EPOCH, CheckpointStore, VersionInfo

TRAIN_FLOW = "ckptflow-train"  # the training flow's name (flows/train.py)
EVENTS_PAGE = 50  # the most events the API gives per page


@contextmanager
def prefect_client() -> Iterator[Any]:
    """A synchronous client of the configured Prefect API, for the block."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        yield client


# -- flow runs of training --


def active_train_runs(client: Any) -> list[Any]:
    """The ``ckptflow-train`` flow runs in Pending, Running or Cancelling."""
    from prefect.client.schemas.objects import StateType

    return _train_runs(client, [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING])


def crashed_train_runs(client: Any, *, limit: int, ended_after: datetime | None = None) -> list[Any]:
    """The newest ``limit`` Crashed ``ckptflow-train`` flow runs, the latest started first; with
    ``ended_after``, only those that entered a final state (Crashed) after it."""
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    return _train_runs(
        client, [StateType.CRASHED], ended_after=ended_after, sort=FlowRunSort.START_TIME_DESC, limit=limit
    )


def _train_runs(
    client: Any, states: list[Any], *, ended_after: datetime | None = None, **query: Any
) -> list[Any]:
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterEndTime,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )

    state = FlowRunFilterState(type=FlowRunFilterStateType(any_=states))
    ended = FlowRunFilterEndTime(after_=ended_after) if ended_after is not None else None
    return list(
        client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[TRAIN_FLOW])),
            flow_run_filter=FlowRunFilter(state=state, end_time=ended),
            **query,
        )
    )


STORE_LABEL = "ckptflow.store"  # a training run's store, canonical (CheckpointStore.canonical_url)
COMMIT_LABEL = "ckptflow.last_commit"  # the newest version the run committed, as JSON (VersionInfo's fields)


def store_url_of(run: Any) -> str | None:
    """The store a training flow run writes to, by its one name (``CheckpointStore.canonical_url``):
    as the run recorded it when it started; for a run without that record, from its config's
    ``storage`` when that is absolute or a URL (a relative path named a directory of the process
    that ran it, unknown here). None if neither says."""
    recorded = (run.labels or {}).get(STORE_LABEL)
    if isinstance(recorded, str) and recorded:
        return recorded
    config = (run.parameters or {}).get("config")
    storage = config.get("storage") if isinstance(config, dict) else None
    if not isinstance(storage, str) or ("://" not in storage and not os.path.isabs(storage)):
        return None
    try:
        return CheckpointStore(storage).canonical_url
    except Exception:
        return storage


def on_store(runs: list[Any], store: CheckpointStore) -> list[Any]:
    """Those of ``runs`` that write to ``store``, however each wrote its URL."""
    name = store.canonical_url
    return [run for run in runs if store_url_of(run) == name]


def record_commit(client: Any, flow_run_id: UUID, info: VersionInfo) -> None:
    """Record on the flow run the newest version it committed: what its record (a summary written
    after it crashed) says it committed, whatever is left in the store later."""
    doc = {k: v for k, v in dataclasses.asdict(info).items() if k not in ("user", "lineage")}
    doc["user"] = {k: info.user[k] for k in (IN_EPOCH, EPOCH_STEPS) if k in info.user}
    client.update_flow_run_labels(flow_run_id, {COMMIT_LABEL: json.dumps(doc, separators=(",", ":"))})


def recorded_commit(run: Any) -> VersionInfo | None:
    """The newest version a flow run recorded it committed (:func:`record_commit`); None if it
    recorded none (a run of an older ckptflow, or one that committed nothing)."""
    raw = (run.labels or {}).get(COMMIT_LABEL)
    if not isinstance(raw, str):
        return None
    try:
        return VersionInfo(**json.loads(raw))
    except (TypeError, ValueError):
        return None


def label_flow_run(client: Any, flow_run_id: UUID, labels: dict[str, bool | int | float | str]) -> None:
    client.update_flow_run_labels(flow_run_id, labels)


def mark_crashed(client: Any, flow_run_id: UUID, message: str) -> None:
    """Set the flow run Crashed, whatever its state (its process is gone and cannot)."""
    from prefect.states import Crashed

    client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)


def mark_open_task_runs_crashed(client: Any, flow_run_id: UUID, message: str) -> list[str]:
    """Set Crashed the task runs of the flow run still Pending, Running or Scheduled; their names."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    open_states = [StateType.PENDING, StateType.RUNNING, StateType.SCHEDULED]
    return set_task_runs_state(client, flow_run_id, open_states, lambda: Crashed(message=message))


def set_task_runs_state(client: Any, flow_run_id: UUID, types: list[Any], state: Any) -> list[str]:
    """Force ``state()`` on the task runs of the flow run whose state is of ``types``; their names."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )

    names = []
    for task_run in client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
        task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=types))),
    ):
        client.set_task_run_state(task_run.id, state(), force=True)
        names.append(task_run.name)
    return names


def cancel_requested(flow_run_id: UUID) -> bool:
    """Whether the flow run is Cancelling or Cancelled (an API error raises)."""
    with prefect_client() as client:
        state = client.read_flow_run(flow_run_id).state
    return state is not None and (state.is_cancelling() or state.is_cancelled())


def current_run_ids() -> tuple[UUID | None, UUID | None]:
    """(flow run id, task run id) of the run this is called in; None where there is none."""
    from prefect.context import FlowRunContext, TaskRunContext

    task, flow = TaskRunContext.get(), FlowRunContext.get()
    if task is not None:
        return task.task_run.flow_run_id, task.task_run.id
    if flow is not None and flow.flow_run is not None:
        return flow.flow_run.id, None
    return None, None


# -- what ckptflow attaches to runs --


def flow_runs_with_artifacts(client: Any, flow_run_ids: list[UUID], keys: list[str]) -> set[UUID]:
    """Which of the flow runs have an artifact with one of ``keys``."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    artifacts = client.read_artifacts(
        artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=flow_run_ids), key=ArtifactFilterKey(any_=keys)
        )
    )
    return {a.flow_run_id for a in artifacts}


def newest_artifact_id(client: Any, flow_run_id: UUID, key: str) -> UUID | None:
    """The id of the flow run's newest artifact ``key`` (the one its page shows); None if none."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    artifacts = client.read_artifacts(
        artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])
        ),
        sort=ArtifactSort.CREATED_DESC,
        limit=1,
    )
    return artifacts[0].id if artifacts else None


def create_artifact(
    *, key: str, kind: str, data: Any, description: str, flow_run_id: UUID | None, task_run_id: UUID | None
) -> UUID:
    """A new version of the artifact ``key``, of the given flow run (and task run); its id."""
    from prefect.client.schemas.actions import ArtifactCreate

    artifact = ArtifactCreate(
        key=key,
        type=kind,
        data=data,
        description=description,
        flow_run_id=flow_run_id,
        task_run_id=task_run_id,
    )
    with prefect_client() as client:
        return client.create_artifact(artifact).id


def update_artifact(artifact_id: UUID, data: Any, description: str) -> UUID:
    """Update the artifact in place; its id."""
    from prefect.client.schemas.actions import ArtifactUpdate

    with prefect_client() as client:
        client.update_artifact(artifact_id, ArtifactUpdate(data=data, description=description))
    return artifact_id


def events_with_ids(ids: Collection[UUID], *, since: datetime, until: datetime) -> set[UUID]:
    """Which of the events ``ids`` the server holds, among those that occurred in [since, until]."""
    from prefect.events.filters import EventFilter, EventIDFilter, EventOccurredFilter

    query = EventFilter(
        occurred=EventOccurredFilter(since=since, until=until), id=EventIDFilter(id=list(ids))
    )
    with prefect_client() as client:
        page = client.read_events(query, limit=EVENTS_PAGE)
        found = {e.id for e in page.events if e.id in ids}
        while page.next_page is not None:
            page = client.read_events_page(str(page.next_page))
            found |= {e.id for e in page.events if e.id in ids}
    return found


__all__ = [
    "TRAIN_FLOW",
    "active_train_runs",
    "cancel_requested",
    "crashed_train_runs",
    "create_artifact",
    "current_run_ids",
    "events_with_ids",
    "flow_runs_with_artifacts",
    "label_flow_run",
    "mark_crashed",
    "mark_open_task_runs_crashed",
    "newest_artifact_id",
    "on_store",
    "prefect_client",
    "record_commit",
    "recorded_commit",
    "set_task_runs_state",
    "store_url_of",
    "update_artifact",
]
