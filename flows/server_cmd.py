"""`ckptflow setup-server` and `ckptflow publish`: the commands that talk to a Prefect server.

``setup-server`` makes a server ready for ckptflow's deployments, and can be
run again at any time (it converges, it never duplicates):

- the ``process`` work pool the deployments of ``deployments/prefect.yaml`` target;
- an automation that marks a flow run Crashed when its heartbeats stop. A flow
  run started by a worker or by ``serve`` emits ``prefect.flow-run.heartbeat``
  every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds (30 in the deployments);
  if its process dies with its worker (a lost machine, a SIGKILL, an OOM
  kill), nobody reports its end and it would sit in Running forever. The
  automation is Prefect's recipe: a proactive trigger, per flow run, that
  expects a heartbeat or a final state within ``--within`` seconds of the last
  heartbeat. ``--within`` must exceed the heartbeat period with room for delays.

``publish`` runs a small flow that publishes a store's checkpoint table and
latest checkpoint as artifacts (keys per store), and prints where to see them.

Both need a Prefect server (``PREFECT_API_URL``), not the temporary one a local
run starts. Prefect is imported inside the commands only.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from .options import parse_storage_options

DEFAULT_POOL = "ckptflow-process"
AUTOMATION_NAME = "ckptflow: crash flow runs whose heartbeats stopped"
FINAL_EVENTS = ("Completed", "Failed", "Cancelled", "Crashed")


def _api_settings() -> tuple[str, str]:
    """(API URL, UI URL) of the configured Prefect server; exit 1 when there is none."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if not settings.api.url:
        typer.echo(
            "error: no Prefect server configured: start one (`prefect server start`) and set "
            "PREFECT_API_URL=http://127.0.0.1:4200/api (or `prefect config set PREFECT_API_URL=...`)",
            err=True,
        )
        raise typer.Exit(1)
    return settings.api.url, settings.ui_url or settings.api.url.removesuffix("/api")


def heartbeat_automation(within_seconds: float) -> Any:
    """The automation (Prefect's zombie-run recipe) that marks silent Running flow runs Crashed."""
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=AUTOMATION_NAME,
        description=(
            "A flow run that stops emitting prefect.flow-run.heartbeat without reaching a final state "
            "(its process died) is marked Crashed. Created by `ckptflow setup-server`."
        ),
        trigger=EventTrigger(
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in FINAL_EVENTS)},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_seconds),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"No heartbeat for {within_seconds:g}s: the flow run's process died "
                "(marked by the ckptflow heartbeat automation)",
            )
        ],
    )


def ensure_work_pool(client: Any, name: str) -> str:
    """Create the process work pool unless it exists; return what was done."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    try:
        pool = client.read_work_pool(name)
    except ObjectNotFound:
        template = ProcessWorker.get_default_base_job_template()
        client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
        return "created"
    if pool.type != "process":
        typer.echo(f"error: work pool {name!r} exists with type {pool.type!r}, not 'process'", err=True)
        raise typer.Exit(1)
    return "exists"


def ensure_automation(client: Any, within_seconds: float) -> tuple[str, Any]:
    """Create the heartbeat automation, or bring the one of that name up to date; return (what, id)."""
    wanted = heartbeat_automation(within_seconds)
    found = client.read_automations_by_name(AUTOMATION_NAME)
    if not found:
        return "created", client.create_automation(wanted)
    first, *duplicates = found
    for extra in duplicates:
        client.delete_automation(extra.id)
    client.update_automation(first.id, wanted)
    return "updated", first.id


def setup_server_command(
    pool: Annotated[str, typer.Option("--pool", help="The process work pool to create.")] = DEFAULT_POOL,
    within: Annotated[
        float,
        typer.Option(
            "--within",
            min=10,
            metavar="SECONDS",
            help="Mark a Running flow run Crashed after this long without a heartbeat "
            "(keep it above the heartbeat period, 30 s in the deployments).",
        ),
    ] = 90.0,
    automation: Annotated[
        bool, typer.Option("--automation/--no-automation", help="Create the heartbeat automation.")
    ] = True,
) -> None:
    """Create the work pool and the crashed-run automation on the Prefect server (idempotent)."""
    _, ui = _api_settings()
    from ckptflow.tasks.reporting.prefect_runs import prefect_client

    with prefect_client() as client:
        done = ensure_work_pool(client, pool)
        typer.echo(f"work pool {pool!r} (process): {done}  {ui}/work-pools/work-pool/{pool}")
        if automation:
            done, automation_id = ensure_automation(client, within)
            typer.echo(
                f"automation {AUTOMATION_NAME!r} (no heartbeat for {within:g}s -> Crashed): {done}  "
                f"{ui}/automations/automation/{automation_id}"
            )
    typer.echo(f"next: prefect worker start --pool {pool}")


def publish_command(
    url: Annotated[str, typer.Argument(metavar="URL", help="The store: a path, file://..., s3://...")],
    storage_options: Annotated[
        str | None,
        typer.Option(
            "--storage-options",
            metavar="JSON",
            envvar="CKPTFLOW_STORAGE_OPTIONS",
            help="fsspec options (credentials too): used by this process only, never sent to Prefect.",
            show_default=False,
        ),
    ] = None,
    storage_secret: Annotated[
        str | None,
        typer.Option(
            "--storage-secret",
            metavar="BLOCK",
            help="Prefect block with credentials: a Secret block NAME or aws-credentials/NAME.",
        ),
    ] = None,
) -> None:
    """Publish a store's checkpoints to the Prefect UI, without a training run (prints the links)."""
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    options = parse_storage_options(storage_options) if storage_options else {}
    _, ui = _api_settings()
    from ckptflow.flows.maintenance import publish_store_checkpoints
    from ckptflow.tasks.maintenance import private_storage_options
    from ckptflow.tasks.reporting.monitoring import store_key

    with private_storage_options(options):
        state = publish_store_checkpoints(storage=url, storage_secret=storage_secret, return_state=True)
    run_id = state.state_details.flow_run_id
    if not state.is_completed():
        typer.echo(f"error: {_state_error(state)} (flow run {ui}/runs/flow-run/{run_id})", err=True)
        raise typer.Exit(1)
    result = state.result()
    key = store_key(result["storage"])
    ids = result["artifacts"]
    if any(v is None for v in ids.values()):
        typer.echo(
            f"error: the Prefect server refused the artifacts (flow run {ui}/runs/flow-run/{run_id})",
            err=True,
        )
        raise typer.Exit(1)
    typer.echo(f"published {len(result['versions'])} committed checkpoint(s) of {result['storage']}")
    typer.echo(f"  checkpoint table:  {ui}/artifacts/artifact/{ids[f'{key}-checkpoints']}")
    typer.echo(f"  latest checkpoint: {ui}/artifacts/artifact/{ids[f'{key}-latest']}")
    typer.echo(f"  history:           {ui}/artifacts/key/{key}-latest")
    typer.echo(f"  flow run:          {ui}/runs/flow-run/{run_id}")


def _state_error(state: Any) -> str:
    try:
        state.result()
    except BaseException as exc:
        return " ".join(str(exc).split()) or type(exc).__name__
    return state.message or "the flow run did not complete"
