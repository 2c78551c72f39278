"""What ``--upload-to`` mirrors, and what a run says about it at the end (issue 14).

- By default the mirror gets every committed version, the newest loose ones
  included, not only the archived ones; ``--no-upload-versions`` keeps it to tarballs.
- Every run with an upload target ends with one line naming the committed
  versions the mirror lacks (or saying it holds them all): in the CLI's output,
  the flow's result and its summary artifact. A target that refuses every
  upload does not stop training: the run trains to the end, then fails with the
  reason and that line.

Against a real Prefect server and a SeaweedFS S3 server; the CLI runs in this process.
"""

from __future__ import annotations

import itertools
import json
import shutil
from typing import Any

import pytest
from typer.testing import CliRunner

from ckptflow.storage import CheckpointStore
from ckptflow.storage.archive.tarballs import list_archived
from ckptflow.tasks.config import ArchiveConfig
from ckptflow.tasks.reporting.mirroring import check_mirror, mirrored_versions, version_ranges
from tests.conftest import assert_same_state
from tests.pipeline.helpers import make_config, poll, run_summary, version_dirs
from tests.pipeline.specs import MARKED_SPEC, SPEC_CONFIG
from tests.ports import free_port


def run_cli(*args: str) -> Any:
    from ckptflow.flows.cli import app

    return CliRunner().invoke(app, list(args))


def run_args(store: Any, epochs: int) -> list[str]:
    return ["run", "--storage", str(store), "--epochs", str(epochs), "--spec", MARKED_SPEC,
            "--spec-config", json.dumps(SPEC_CONFIG), "--shards", "2"]  # fmt: skip


def summary_markdown(storage: str) -> str:
    """The summary artifact of the newest training flow run on ``storage``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import FlowRunSort

    from ckptflow.tasks.reporting.monitoring import slug

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC)
        run = next(r for r in runs if r.parameters.get("config", {}).get("storage") == storage)
        key = f"ckptflow-{slug(run.name)}-summary"

        def read() -> list[Any]:
            return client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]), key=ArtifactFilterKey(any_=[key])
                )
            )

        found = poll(read, bool)
    assert found, f"no summary artifact for flow run {run.name}"
    return str(found[-1].data)


def refused_endpoint() -> str:
    """An endpoint on 127.0.0.1 where nothing listens: every connection is refused."""
    return f"http://127.0.0.1:{free_port()}"


class TestConfig:
    """``upload_versions`` is on by default with a target; old configs that set it still validate."""

    def test_default_follows_the_target(self):
        assert ArchiveConfig(upload_to="s3://b/run").mirrors_versions()
        assert not ArchiveConfig().mirrors_versions()
        assert not ArchiveConfig(upload_to="s3://b/run", upload_versions=False).mirrors_versions()
        assert ArchiveConfig(upload_to="s3://b/run", upload_versions=True).mirrors_versions()
        assert not ArchiveConfig(upload_versions=False).mirrors_versions()
        with pytest.raises(ValueError, match=r"upload_versions needs archive\.upload_to"):
            ArchiveConfig(upload_versions=True)

    def test_version_ranges(self):
        assert version_ranges([5, 1, 2, 3, 8, 7]) == "1-3, 5, 7-8"
        assert version_ranges([4]) == "4" and version_ranges([]) == "none"


class TestMirrorLine:
    """The mirror's own listing decides; when it cannot be listed, only this run's verified uploads count."""

    def make_store(self, tmp_path) -> CheckpointStore:
        import torch

        store = CheckpointStore(str(tmp_path / "store"))
        for epoch in (1, 2, 3):
            store.save({"w": torch.full((4,), float(epoch))}, epoch=epoch, version=epoch)
        return store

    def test_a_version_counts_once_its_manifest_is_on_the_mirror(self, tmp_path):
        store = self.make_store(tmp_path)
        mirror = tmp_path / "mirror"
        shutil.copytree(tmp_path / "store" / "v000001", mirror / "v000001")
        shutil.copytree(tmp_path / "store" / "v000002", mirror / "v000002")
        (mirror / "v000002" / "manifest.json").unlink()  # an upload cut off before its commit
        config = ArchiveConfig(upload_to=str(mirror))
        status = check_mirror(
            store,
            str(mirror),
            lambda: mirrored_versions(str(mirror), {}),
            config=config,
            confirmed=set(),
            failures=[],
        )
        assert (status.committed, status.missing) == ([1, 2, 3], [2, 3])
        assert status.line() == (
            f"mirror {mirror}: versions 2-3 not mirrored yet (their uploads have not run yet; "
            "the next run with this upload target uploads them)"
        )

    def test_an_unlistable_mirror_counts_only_the_uploads_verified_in_this_run(self, tmp_path):
        store = self.make_store(tmp_path)

        def unreachable() -> set[int]:
            raise OSError("connection refused")

        config = ArchiveConfig(upload_to="s3://b/run")
        status = check_mirror(store, "s3://b/run", unreachable, config=config, confirmed={2}, failures=[])
        assert status.missing == [1, 3]
        assert status.line().startswith(
            "mirror s3://b/run: versions 1, 3 not mirrored yet (could not list the mirror: connection refused"
        )
        everything = check_mirror(
            store, "s3://b/run", lambda: {1, 2, 3}, config=config, confirmed=set(), failures=[]
        )
        assert everything.line() == "mirror s3://b/run: all 3 committed versions mirrored"


@pytest.mark.prefect
@pytest.mark.s3
class TestMirrorByDefault:
    def test_run_mirrors_the_newest_loose_versions_too(
        self, prefect_server, s3_server, s3_bucket, tmp_path, monkeypatch
    ):
        """Bug fix: with ``--upload-to``, only archived versions reached the mirror.

        ``--epochs 4 --archive-every 3`` left version 4 loose and local only, unless
        ``--upload-versions``; now the mirror lists and loads 1-4, and the run says so.
        """
        bucket, _ = s3_bucket
        monkeypatch.setenv("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server)  # botocore's own setting, read by s3fs
        store = tmp_path / "store"
        mirror = f"s3://{bucket}/run"
        result = run_cli(*run_args(store, 4), "--archive-every", "3", "--upload-to", mirror)
        assert result.exit_code == 0, result.output
        assert version_dirs(store) == ["v000004"]  # 1-3 in a tarball here

        listing = run_cli("ls", mirror, "--json")
        assert listing.exit_code == 0, listing.output
        assert [v["version"] for v in json.loads(listing.output)["versions"]] == [1, 2, 3, 4]
        remote = CheckpointStore(mirror, storage_options={"skip_instance_cache": True})
        assert sorted(list_archived(remote.loc)) == [1, 2, 3]
        local = CheckpointStore(str(store))
        for v in (1, 2, 3, 4):
            remote.verify(v)
            assert_same_state(remote.load(v), local.load(v))
        line = f"mirror {mirror}: all 4 committed versions mirrored"
        assert line in result.output
        assert line in summary_markdown(str(store))

    def test_no_upload_versions_mirrors_archives_only_and_says_what_is_missing(
        self, prefect_server, s3_server, s3_bucket, tmp_path
    ):
        bucket, _ = s3_bucket
        mirror = f"s3://{bucket}/run"
        options = {"client_kwargs": {"endpoint_url": s3_server}}
        archive = {"every": 2, "upload_to": mirror, "upload_options": options, "upload_versions": False}
        config = make_config(tmp_path / "store", epochs=3, archive=archive)
        summary, _ = run_summary(config)
        remote = CheckpointStore(mirror, storage_options={**options, "skip_instance_cache": True})
        assert [(v.version, v.archived) for v in remote.versions()] == [(1, True), (2, True)]
        assert summary["not_mirrored"] == [3]
        line = f"mirror {mirror}: versions 3 not mirrored yet (upload_versions is off"
        assert summary["mirror_line"].startswith(line)
        assert line in summary_markdown(config.storage)


@pytest.mark.prefect
@pytest.mark.s3
def test_a_refusing_target_ends_the_run_with_the_versions_not_mirrored(prefect_server, tmp_path, monkeypatch):
    """Bug fix: a failed upload failed the run mid-training with a raw error, and no run said
    which committed versions the mirror lacked. Training now goes on; the run ends Failed with
    the reason, and one line names the versions not mirrored (log and summary artifact).

    The flow runs here directly: the target fails during the run, past any check before it. The
    store holds a version of its own first: a run that cannot read its durable tier goes on from
    it (with an empty store it would fail at once, tests/pipeline/test_tiers.py).
    """
    from ckptflow.tasks import archiving
    from tests.pipeline.helpers import run_flow

    # Retries still happen at both levels (the task's, the S3 client's), with little backoff:
    # the endpoint refuses at once every time.
    slow = archiving.upload_version
    monkeypatch.setattr(archiving, "upload_version", slow.with_options(retry_delay_seconds=0))
    mirror = "s3://mirror-bucket/run"
    refused = {
        "client_kwargs": {"endpoint_url": refused_endpoint()},
        "config_kwargs": {"retries": {"total_max_attempts": 2}},
    }
    archive = {"upload_to": mirror, "upload_options": refused}
    run_flow(make_config(tmp_path / "store", epochs=1))  # the fast tier holds a version: the run goes on
    config = make_config(tmp_path / "store", epochs=3, archive=archive)
    state, _ = run_flow(config)
    assert state.is_failed(), state
    assert state.message.startswith(
        "training ended at epoch 3, but upload of version 1 failed: cannot reach the object store at http://"
    )
    line = summary_line(config.storage, mirror)
    assert line.startswith(f"mirror {mirror}: versions 1-3 not mirrored yet (upload of version 1 failed: ")
    local = CheckpointStore(config.storage)  # training was not stopped: every epoch committed
    assert [v.version for v in local.versions()] == [1, 2, 3]
    for v in (1, 2, 3):
        local.verify(v)


def summary_line(storage: str, mirror: str) -> str:
    """The mirror line of the newest run's summary artifact (markdown bold stripped)."""
    found = [
        ln.strip("*") for ln in summary_markdown(storage).splitlines() if ln.startswith(f"**mirror {mirror}")
    ]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.prefect
def test_a_silent_target_never_holds_training_up(prefect_server, silent_endpoint, tmp_path, monkeypatch):
    """Bug fix: behind an upload target that accepts connections and never answers, training sat
    still (a commit waited for the oldest upload job once ``max_pending`` were queued), for as
    long as that job took to fail. Commits now never wait: what is due beyond ``max_pending``
    waits in the queue, every epoch commits at training's pace, and the run ends Failed, naming
    the upload that failed and the versions the mirror lacks.
    """
    from datetime import datetime

    from ckptflow.tasks import archiving
    from tests.pipeline.helpers import run_flow

    monkeypatch.setattr(archiving, "upload_version", archiving.upload_version.with_options(retries=1))
    mirror = "s3://mirror-bucket/run"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    silent = {
        "client_kwargs": {"endpoint_url": silent_endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 2, "read_timeout": 2, "retries": {"total_max_attempts": 1}},
    }
    archive = {"upload_to": mirror, "upload_options": silent}
    run_flow(make_config(tmp_path / "store", epochs=1))  # as above: the run goes on from its own
    config = make_config(tmp_path / "store", epochs=6, archive=archive)
    state, _ = run_flow(config)

    store = CheckpointStore(config.storage)
    versions = store.versions()
    assert [v.version for v in versions] == [1, 2, 3, 4, 5, 6]  # training ran to the end
    created = [datetime.fromisoformat(v.created).timestamp() for v in versions[1:]]  # this run's
    gaps = [b - a for a, b in itertools.pairwise(created)]
    # Each upload attempt needs at least one 2 s read timeout, and a job makes two attempts with a
    # retry delay between them: a commit that waited for one would leave a gap of over 4 s.
    assert max(gaps) < 4, gaps
    assert state.is_failed(), state
    assert "upload of version 1 failed" in state.message
    line = summary_line(config.storage, mirror)
    assert line.startswith(f"mirror {mirror}: versions 1-6 not mirrored yet (upload of version 1 failed")
