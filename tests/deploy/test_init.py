"""`ckptflow deployments init`: an installed ckptflow gets the deployment files, and they deploy.

The user of a wheel has no checkout: the command writes deployments/prefect.yaml and
deployments/serve.py into a directory of theirs. From there, the README's commands
(`ckptflow setup-server`, `prefect deploy`, a worker) train into a store that a relative
path names inside that directory, with a spec module of the user's own that lives there.
Its own Prefect server: a second `prefect deploy` of the same names must not touch the
package's shared stack.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.deploy.helpers import REPO, TRAIN, Stack, Worker, checked, command, start_run, wait_for_state
from tests.pipeline.helpers import assert_only_committed
from tests.prefect_server import start_prefect_server, talking_to

pytestmark = pytest.mark.deploy

WRITTEN = ["deployments/prefect.yaml", "deployments/serve.py"]
MY_SPECS = """
from ckptflow.flows.demo import DigitsSpec


class TinySpec(DigitsSpec):
    \"\"\"The demo, from a spec module of the user's beside prefect.yaml.\"\"\"
"""


def init(where: Path, *args: str):
    return command(None, "ckptflow", "deployments", "init", *args, cwd=where)


def test_init_writes_the_files_of_the_checkout_and_replaces_them_only_when_told(tmp_path):
    done = init(tmp_path)
    assert done.returncode == 0, done.stderr
    for name in WRITTEN:
        assert (tmp_path / name).read_bytes() == (REPO / name).read_bytes()
    assert "prefect deploy --all --prefect-file deployments/prefect.yaml" in done.stdout

    edited = tmp_path / "deployments" / "prefect.yaml"
    edited.write_text("# my changes\n")
    again = init(tmp_path)
    assert again.returncode == 1
    assert again.stderr.strip() == (
        f"error: {Path('deployments/prefect.yaml')}, {Path('deployments/serve.py')} exists already: "
        "--force replaces it"
    )
    assert edited.read_text() == "# my changes\n"  # nothing replaced

    forced = init(tmp_path, "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout) == {"written": WRITTEN, "replaced": WRITTEN}
    assert edited.read_bytes() == (REPO / "deployments" / "prefect.yaml").read_bytes()


def test_init_into_a_named_directory_it_creates(tmp_path):
    done = init(tmp_path, "project/ops")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "project" / "ops" / "deployments").iterdir()) == [
        "prefect.yaml",
        "serve.py",
    ]


def test_the_written_deployment_trains_in_the_users_directory(tmp_path_factory):
    """Deployed from a directory outside the checkout; the worker started from a third one."""
    project = tmp_path_factory.mktemp("project")
    assert init(project).returncode == 0
    (project / "my_specs.py").write_text(MY_SPECS)
    server = start_prefect_server(tmp_path_factory.mktemp("init-prefect-home"))
    try:
        with talking_to(server):
            stack = Stack(server, "", "")
            checked(stack, "ckptflow", "setup-server", cwd=project)
            deploy = checked(
                stack, "prefect", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml",
                "--no-prompt", cwd=project,
            )  # fmt: skip
            assert f"Deployment '{TRAIN}' successfully created" in deploy
            config = {"storage": "./checkpoints/mine", "epochs": 2, "shards": 1, "spec": "my_specs:TinySpec"}
            run_id = start_run(stack, TRAIN, config)
            elsewhere = tmp_path_factory.mktemp("worker")
            with Worker(stack, elsewhere / "worker.log") as worker:
                assert worker.wait(180) == 0, worker.output()[-4000:]
            run = wait_for_state(run_id, "COMPLETED", "FAILED", "CRASHED", timeout=30)
            assert run.state.type.value == "COMPLETED", f"{run.state}\n{worker.output()[-4000:]}"
    finally:
        server.stop()
    assert assert_only_committed(project / "checkpoints" / "mine") == [1, 2]
    assert not (elsewhere / "checkpoints").exists()
