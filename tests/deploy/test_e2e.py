"""End to end: deploy from the repository, run on a worker, read the results back through the API.

The package's ``stack`` is a real `prefect server start` set up with
`ckptflow setup-server` and `prefect deploy --all --prefect-file
deployments/prefect.yaml`; ``trained`` is one run of the training deployment
(`prefect deployment run ... --param config=...`) executed by `prefect worker
start --run-once` started outside the repository. Then the maintenance
deployment runs on a worker, `ckptflow publish` publishes a store without a
run, and `RunMonitor.uploaded` makes a link artifact.
"""

from __future__ import annotations

import json
import os
import shutil
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from ckptflow.flows.server_cmd import AUTOMATION_NAME
from ckptflow.storage import CheckpointStore
from ckptflow.tasks.reporting.formatting import human_size
from ckptflow.tasks.reporting.monitoring import COMMITTED_EVENT, RunMonitor, slug, store_key
from tests.deploy.conftest import TRAINED_EPOCHS
from tests.deploy.helpers import (
    MAINTENANCE,
    POOL,
    REPO,
    TRAIN,
    Worker,
    checked,
    command,
    events,
    latest_artifact,
    poll_until,
    run_artifact,
    run_artifacts,
    start_run,
    table_rows,
    wait_for_state,
)
from tests.pipeline.helpers import assert_only_committed

pytestmark = pytest.mark.deploy

EPOCHS = list(range(1, TRAINED_EPOCHS + 1))


def deployment(name: str):
    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


class TestDeploy:
    def test_prefect_deploy_creates_both_deployments_without_prompts(self, stack):
        out = stack.deploy_output
        assert f"Deployment '{TRAIN}' successfully created" in out
        assert f"Deployment '{MAINTENANCE}' successfully created" in out

    def test_the_worker_finds_the_code_of_this_checkout(self, stack):
        train = deployment(TRAIN)
        assert train.entrypoint == "ckptflow.flows.train.train_pipeline"
        assert train.work_pool_name == POOL
        assert train.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
        ]
        assert train.job_variables["working_dir"] == str(REPO)
        assert train.job_variables["env"] == {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}
        assert train.parameters == {
            "config": {
                "storage": "./checkpoints/deployed",
                "epochs": 5,
                "save_every": 1,
                "shards": 4,
                "async_save": True,
            }
        }

    def test_maintenance_runs_nightly(self, stack):
        maintenance = deployment(MAINTENANCE)
        assert maintenance.entrypoint == "ckptflow.flows.maintenance.maintain_stores"
        assert maintenance.work_pool_name == POOL
        assert [(s.schedule.cron, s.schedule.timezone) for s in maintenance.schedules] == [
            ("0 3 * * *", "UTC")
        ]
        assert maintenance.parameters["config"]["storages"] == ["./checkpoints/deployed"]

    def test_setup_server_is_idempotent(self, stack):
        assert "created" in stack.setup_output
        again = checked(stack, "ckptflow", "setup-server")
        assert f"work pool '{POOL}' (process): exists" in again
        assert "updated" in again
        with get_client(sync_client=True) as client:
            assert len(client.read_automations_by_name(AUTOMATION_NAME)) == 1
            assert client.read_work_pool(POOL).type == "process"

    def test_the_server_refuses_parameters_outside_the_schema(self, stack, tmp_path):
        config = json.dumps({"storage": str(tmp_path / "s"), "epochs": 0})
        done = command(stack, "prefect", "deployment", "run", TRAIN, "--param", f"config={config}")
        assert done.returncode == 1
        assert "Validation failed for field 'config.epochs'" in " ".join((done.stdout + done.stderr).split())

    def test_the_flow_refuses_credentials_in_its_parameters(self, stack, tmp_path):
        """What the schema cannot say (no credentials in storage_options) the flow checks: the run fails."""
        config = {"storage": str(tmp_path / "s"), "storage_options": {"secret": "x"}, "epochs": 1}
        run_id = start_run(stack, TRAIN, config)
        with Worker(stack, tmp_path / "worker.log") as worker:
            worker.wait(180)
        run = wait_for_state(run_id, "FAILED", "COMPLETED", "CRASHED", timeout=30)
        assert run.state.type.value == "FAILED", run.state
        assert "must not hold credentials (secret)" in worker.output()
        assert not (tmp_path / "s").exists()


class TestTrainingRun:
    def test_completed_on_the_worker(self, trained):
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(trained.run_id)
        assert run.state is not None and run.state.type.value == "COMPLETED"
        assert run.deployment_id == deployment(TRAIN).id
        assert run.work_pool_name == POOL
        assert run.parameters["config"]["storage"] == str(trained.storage)
        assert f"Flow run '{trained.name}' submitted to infrastructure" in trained.worker_log
        # deployed runs train in trainers by default, as `ckptflow run` does
        assert "training in a training process (launcher pid" in trained.worker_log

    def test_storage_holds_the_committed_versions(self, trained):
        assert assert_only_committed(trained.storage) == EPOCHS

    def test_checkpoint_table_has_one_row_per_committed_epoch(self, trained):
        table = run_artifact(trained.run_id, f"ckptflow-{slug(trained.name)}-checkpoints")
        rows = table_rows(table)
        versions = CheckpointStore(str(trained.storage)).versions()
        assert [r["epoch"] for r in rows] == EPOCHS
        assert [r["version"] for r in rows] == [v.version for v in versions]
        assert [r["size"] for r in rows] == [human_size(v.size) for v in versions]
        assert [r["url"] for r in rows] == [v.url for v in versions]

    def test_store_artifacts_show_the_latest_checkpoint(self, trained):
        store = CheckpointStore(str(trained.storage))
        key = store_key(store.url)
        latest = latest_artifact(f"{key}-latest")
        newest = store.latest()
        assert newest is not None and newest.version == TRAINED_EPOCHS
        assert f"| version | {newest.version} (epoch {newest.epoch}) |" in latest.data
        assert f"| size | {human_size(newest.size)} |" in latest.data
        assert newest.url in latest.data
        assert f"flow run `{trained.name}`" in latest.data
        assert [r["epoch"] for r in table_rows(latest_artifact(f"{key}-checkpoints"))] == EPOCHS
        # ...and the run links to both from its Artifacts tab, one card per key.
        keys = sorted(a.key for a in run_artifacts(trained.run_id))
        prefix = f"ckptflow-{slug(trained.name)}"
        assert keys == sorted(
            [f"{key}-checkpoints", f"{key}-latest"]
            + [f"{prefix}-{p}" for p in ("checkpoints", "progress", "summary", "curve", "latest")]
        )

    def test_committed_events_and_heartbeats(self, trained):
        committed = poll_until(
            lambda: events(COMMITTED_EVENT, trained.run_id), lambda evs: len(evs) >= TRAINED_EPOCHS
        )
        assert sorted(e.payload["epoch"] for e in committed) == EPOCHS
        beats = events("prefect.flow-run.heartbeat", trained.run_id)
        assert beats, "the deployed run emitted no heartbeat"
        assert {e.resource.id for e in beats} == {f"prefect.flow-run.{trained.run_id}"}


class TestMaintenance:
    def test_maintenance_deployment_prunes_collects_and_publishes(self, stack, trained, tmp_path):
        store_dir = tmp_path / "store"
        shutil.copytree(trained.storage, store_dir)
        leftover = store_dir / "v000009"
        leftover.mkdir()
        (leftover / "shard-r0-00.h5").write_bytes(b"half-written")
        config = {"storages": [str(store_dir)], "retention": {"keep_last": 2}, "gc": True}
        run_id = start_run(stack, MAINTENANCE, config)
        with Worker(stack, tmp_path / "worker.log") as worker:
            assert worker.wait(180) == 0, worker.output()[-4000:]
        run = wait_for_state(run_id, "COMPLETED", "FAILED", "CRASHED", timeout=30)
        assert run.state.type.value == "COMPLETED", f"{run.state}\n{worker.output()[-4000:]}"

        assert assert_only_committed(store_dir) == EPOCHS[-2:]
        assert not leftover.exists()
        key = store_key(CheckpointStore(str(store_dir)).url)
        assert [r["epoch"] for r in table_rows(run_artifact(run_id, f"{key}-checkpoints"))] == EPOCHS[-2:]
        assert f"maintenance run `{run.name}`" in run_artifact(run_id, f"{key}-latest").data

    def test_a_store_being_trained_is_only_published(self, stack, trained, tmp_path):
        """gc cannot tell a save in progress from a crashed one: a store being trained is left alone."""
        from prefect.states import Cancelled, Running

        from ckptflow.flows.maintenance import maintain_stores
        from ckptflow.flows.train import train_pipeline

        store_dir = tmp_path / "store"
        shutil.copytree(trained.storage, store_dir)
        in_progress = store_dir / "v000004"
        in_progress.mkdir()
        (in_progress / "shard-r0-00.h5").write_bytes(b"being written")
        with get_client(sync_client=True) as client:
            live = client.create_flow_run(
                train_pipeline, parameters={"config": {"storage": str(store_dir)}}, state=Running()
            )
        try:
            report = maintain_stores({"storages": [str(store_dir)], "retention": {"keep_last": 1}})
        finally:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(live.id, Cancelled(), force=True)
        assert report[0]["busy"] == [live.name]
        assert (report[0]["pruned"], report[0]["gc"]) == ([], [])
        assert (in_progress / "shard-r0-00.h5").read_bytes() == b"being written"
        assert assert_only_committed(store_dir, garbage_allowed=True) == EPOCHS
        assert report[0]["artifacts"]  # ...but its table was published


class TestPublish:
    def test_publish_prints_where_the_table_is(self, stack, trained):
        secret = "publish-s3cr3t"
        out = checked(
            stack,
            "ckptflow",
            "publish",
            str(trained.storage),
            "--storage-options",
            json.dumps({"secret": secret}),
        )
        key = store_key(CheckpointStore(str(trained.storage)).url)
        assert f"published {TRAINED_EPOCHS} committed checkpoint(s) of {trained.storage}" in out
        assert f"{stack.ui}/artifacts/key/{key}-latest" in out
        run_id = UUID(out.split(f"{stack.ui}/runs/flow-run/", 1)[1].split()[0])
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(run_id)
        assert run.state is not None and run.state.type.value == "COMPLETED"
        assert secret not in json.dumps(run.parameters)  # credentials stay in the process
        table = run_artifact(run.id, f"{key}-checkpoints")
        assert f"checkpoint table:  {stack.ui}/artifacts/artifact/{table.id}" in out
        assert [r["epoch"] for r in table_rows(table)] == EPOCHS
        latest = run_artifact(run.id, f"{key}-latest")
        assert f"latest checkpoint: {stack.ui}/artifacts/artifact/{latest.id}" in out
        assert f"| version | {TRAINED_EPOCHS} (epoch {TRAINED_EPOCHS}) |" in latest.data

    def test_publish_needs_a_server(self, tmp_path, trained):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
        env["PREFECT_HOME"] = str(tmp_path / "home")
        done = command(None, "ckptflow", "publish", str(trained.storage), env=env, timeout=60)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "no Prefect server configured" in done.stderr


class TestUploadLink:
    def test_uploaded_makes_a_link_artifact_without_credentials(self, stack):
        @flow(name="ckptflow-upload-link-test")
        def report_upload() -> str:
            from prefect.runtime import flow_run

            name = flow_run.get_name() or "unnamed"
            monitor = RunMonitor(run_name=name, store_url="/data/run1", total_epochs=3)
            monitor.uploaded(
                "s3://bucket/run1/archive/epochs-000001-000003.tar?X-Amz-Signature=abc", 5 * 2**20
            )
            monitor.flush()  # the reporter's thread makes the API calls
            return name

        state = report_upload(return_state=True)
        name, run_id = state.result(), state.state_details.flow_run_id
        assert run_id is not None
        link = run_artifact(run_id, f"ckptflow-{slug(name)}-upload")
        assert link.type == "markdown"
        # an s3:// URL is no address a browser opens: the text to copy, not a link to "Page not found"
        assert (
            link.data
            == "epochs-000001-000003.tar (5.0 MiB): `s3://bucket/run1/archive/epochs-000001-000003.tar`"
        )
        assert "Signature" not in (link.description or "") + link.data
