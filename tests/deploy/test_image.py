"""Deployments that need no checkout: deployments/prefect-docker.yaml, run as its container runs them.

No Docker engine runs on this project's machines (``docker`` is only a client here), so the
image of deployments/Dockerfile is not built in the tests. What is tested instead, on the
real Prefect server of the package's ``stack``:

- a ``docker`` work pool is created and the Docker deployments are deployed from a directory
  outside the repository, with module-path entrypoints and no pull steps;
- a run of the training deployment is executed the way the Docker worker executes it in the
  container: the image's command (``prefect flow-run execute``, with ``PREFECT__FLOW_RUN_ID``)
  as a plain process in an empty directory, importing ckptflow from the installed package;
- the Dockerfile copies what exists, installs extras that pyproject defines, and its command
  is the one run here.
"""

from __future__ import annotations

import json
import re
from importlib.metadata import metadata
from pathlib import Path

import pytest
import yaml
from prefect.client.orchestration import get_client

from ckptflow.storage import CheckpointStore
from ckptflow.tasks.config import DEMO_SPEC
from tests.deploy.helpers import REPO, Stack, checked, command, start_run, wait_for_state

pytestmark = pytest.mark.deploy

POOL = "ckptflow-docker"
TRAIN = "ckptflow-train/train-docker"
MAINTENANCE = "ckptflow-maintenance/maintenance-docker"
DOCKERFILE = REPO / "deployments" / "Dockerfile"
DOCKER_YAML = REPO / "deployments" / "prefect-docker.yaml"


@pytest.fixture(scope="module")
def docker_deployed(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> str:
    elsewhere = tmp_path_factory.mktemp("no-checkout")
    checked(stack, "prefect", "work-pool", "create", POOL, "--type", "docker", cwd=elsewhere)
    return checked(
        stack,
        "prefect",
        "deploy",
        "--all",
        "--prefect-file",
        str(REPO / "deployments" / "prefect-docker.yaml"),
        "--no-prompt",
        cwd=elsewhere,
    )


def test_the_docker_deployments_name_their_flows_by_module_and_pull_nothing(docker_deployed: str) -> None:
    with get_client(sync_client=True) as client:
        train = client.read_deployment_by_name(TRAIN)
        maintenance = client.read_deployment_by_name(MAINTENANCE)
        pool = client.read_work_pool(POOL)
    assert pool.type == "docker"
    assert train.entrypoint == "ckptflow.flows.train.train_pipeline"
    assert maintenance.entrypoint == "ckptflow.flows.maintenance.maintain_stores"
    for deployment in (train, maintenance):
        assert not deployment.pull_steps, deployment.pull_steps
        assert deployment.work_pool_name == POOL
        assert deployment.job_variables["image"] == "ckptflow:0.1.0"
    assert "config" in train.parameter_openapi_schema["properties"]
    assert [s.active for s in maintenance.schedules] == [False]


def test_a_run_executes_as_in_the_container_from_the_installed_package(
    stack: Stack, docker_deployed: str, tmp_path: Path
) -> None:
    container = tmp_path / "container-workdir"
    container.mkdir()
    store = tmp_path / "store"
    run_id = start_run(stack, TRAIN, {"storage": str(store), "epochs": 2, "shards": 2}, cwd=container)
    done = command(
        stack,
        *image_command(),
        cwd=container,
        env=stack.env(PREFECT__FLOW_RUN_ID=str(run_id)),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert wait_for_state(run_id, "COMPLETED", timeout=60).state.type.value == "COMPLETED"
    assert [v.epoch for v in CheckpointStore(store).versions()] == [1, 2]
    assert list(container.iterdir()) == [], "the run wrote into its working directory"


def image_command() -> list[str]:
    """The image's CMD, the command a Docker worker runs in each flow run's container."""
    found = re.search(r"^CMD (\[.*\])$", DOCKERFILE.read_text(), re.M)
    assert found, "deployments/Dockerfile has no CMD in exec form"
    return json.loads(found.group(1))


def test_the_dockerfile_copies_what_exists_and_installs_defined_extras() -> None:
    text = DOCKERFILE.read_text()
    copied = [src for line in re.findall(r"^COPY (.+)$", text, re.M) for src in line.split()[:-1]]
    assert copied and all((REPO / src).exists() for src in copied), copied
    # Bug: deployments/ became a package of the wheel and the image's `pip install .` could not
    # find it: every folder pyproject maps to a package is copied.
    import tomllib

    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    tops = {Path(folder).parts[0] for folder in package_dirs.values()}
    assert tops <= set(copied), f"the Dockerfile copies {copied}, the wheel needs {sorted(tops)}"
    extras = re.search(r"^ARG EXTRAS=(\S+)$", text, re.M)
    assert extras
    defined = metadata("ckptflow").get_all("Provides-Extra") or []
    assert set(extras.group(1).split(",")) <= set(defined), defined
    # Bug: the image lacked the demo's extra, so its default deployment failed at once ("the demo
    # needs scikit-learn"); the test ran the flow in the dev venv, which has scikit-learn.
    deployments = yaml.safe_load(DOCKER_YAML.read_text())["deployments"]
    specs = {
        d["parameters"]["config"].get("spec", DEMO_SPEC)
        for d in deployments
        if "config" in d.get("parameters", {})
    }
    if DEMO_SPEC in specs:
        requires = metadata("ckptflow").get_all("Requires-Dist") or []
        needs = {r.split(";")[0].split(">")[0].strip() for r in requires if 'extra == "demo"' in r}
        assert "demo" in extras.group(1).split(","), (
            f"the default deployment trains the demo, which needs {needs}"
        )
    assert image_command() == ["prefect", "flow-run", "execute"]
