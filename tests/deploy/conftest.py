"""Fixtures of the deployment tests: one Prefect server set up the README's way, shared by the package.

``stack``: `prefect server start` on a free 127.0.0.1 port with a temporary
PREFECT_HOME, then `ckptflow setup-server` (process work pool + heartbeat
automation) and `prefect deploy --all --prefect-file deployments/prefect.yaml`
from the repository root, as subprocesses. The maintenance deployment's cron
schedule is checked and then switched off, so that no scheduled run can reach
a test's worker. This process's Prefect client talks to the server too.

``trained``: one run of the training deployment on a worker (`--run-once`),
for the end-to-end and browser tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import pytest

from tests.deploy.helpers import MAINTENANCE, TRAIN, Stack, Worker, checked, start_run, wait_for_state
from tests.prefect_server import start_prefect_server, talking_to

TRAINED_EPOCHS = 3


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    server = start_prefect_server(tmp_path_factory.mktemp("deploy-prefect-home"))
    try:
        with talking_to(server):
            probe = Stack(server, "", "")
            setup = checked(probe, "ckptflow", "setup-server")
            deploy = checked(
                probe,
                "prefect",
                "deploy",
                "--all",
                "--prefect-file",
                "deployments/prefect.yaml",
                "--no-prompt",
            )
            stack = Stack(server, setup, deploy)
            _switch_off_schedules(MAINTENANCE)
            yield stack
    finally:
        server.stop()


def _switch_off_schedules(deployment: str) -> None:
    """Deactivate the deployment's schedules and drop the runs they already scheduled."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(deployment)
        for schedule in found.schedules:
            client.update_deployment_schedule(found.id, schedule.id, active=False)
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[found.id]))
        )
        for run in runs:
            client.delete_flow_run(run.id)


@dataclass
class Trained:
    run_id: UUID
    name: str
    storage: Path
    worker_log: str
    seconds: float


@pytest.fixture(scope="package")
def trained(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """The training deployment, run once by a worker: 3 epochs into a temporary store."""
    where = tmp_path_factory.mktemp("trained")
    storage = where / "store"
    started = time.monotonic()
    run_id = start_run(stack, TRAIN, {"storage": str(storage), "epochs": TRAINED_EPOCHS, "shards": 2})
    with Worker(stack, where / "worker.log") as worker:
        assert worker.wait(180) == 0, worker.output()[-4000:]
    run = wait_for_state(run_id, "COMPLETED", "FAILED", "CRASHED", timeout=30)
    assert run.state.type.value == "COMPLETED", f"{run.state}\n{worker.output()[-4000:]}"
    return Trained(run_id, run.name, storage, worker.output(), time.monotonic() - started)
