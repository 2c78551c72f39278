"""An automation on ``ckptflow.checkpoint.committed`` fires on each commit (issue 19), on a real server.

The README's recipe: a reactive automation that matches the store's commits
and runs an evaluation deployment with the checkpoint's URL and epoch taken
from the event. Here the deployment has no worker: the flow runs the action
creates (Scheduled) are what the test reads, with their parameters.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from ckptflow.storage import CheckpointStore
from ckptflow.tasks.reporting.monitoring import COMMITTED_EVENT
from tests.pipeline.helpers import make_config, open_store, poll, run_summary

pytestmark = pytest.mark.prefect


@flow(name="ckptflow-test-evaluate")
def evaluate(checkpoint: str, epoch: int) -> None:
    """What an evaluation deployment would run (nothing runs it here)."""


def evaluation_runs(deployment_id: UUID) -> list[Any]:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )


@pytest.mark.parametrize("label", ["ckptflow.store", "ckptflow.storage"])
def test_an_automation_on_the_commit_event_runs_a_deployment_per_checkpoint(
    prefect_server, tmp_path, monkeypatch, label
):
    """Matched by the store's URL (``ckptflow.store``), or by the store as the user wrote it in
    the run's parameters (``ckptflow.storage``: ``./checkpoints/run9``; bug: only the resolved
    absolute path matched)."""
    from prefect.automations import Automation
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    monkeypatch.chdir(tmp_path)
    config = make_config("./checkpoints/run9", epochs=2)
    url = CheckpointStore(config.storage).url
    with get_client(sync_client=True) as client:
        deployment_id = client.create_deployment(
            flow_id=client.create_flow(evaluate), name=f"on-commit-{label}"
        )
    automation = Automation(
        name=f"evaluate each checkpoint of {url} ({label})",
        trigger=EventTrigger(
            expect={COMMITTED_EVENT},
            match=ResourceSpecification({label: url if label == "ckptflow.store" else "./checkpoints/run9"}),
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[
            RunDeployment(
                source="selected",
                deployment_id=deployment_id,
                parameters={"checkpoint": "{{ event.payload.url }}", "epoch": "{{ event.payload.epoch }}"},
            )
        ],
    ).create()
    try:
        run_summary(config)
        versions = open_store(config).versions()
        # the server's triggers service loads a new automation and acts on it in its own time: on
        # a loaded CI machine, more than a minute (seen once, 2026-12-07)
        runs = poll(lambda: evaluation_runs(deployment_id), lambda rs: len(rs) >= 2, timeout=180)
        got = sorted((r.parameters["epoch"], r.parameters["checkpoint"]) for r in runs)
        assert got == [(v.epoch, v.url) for v in versions]  # one run per commit, with its URL and epoch
    finally:
        automation.delete()
