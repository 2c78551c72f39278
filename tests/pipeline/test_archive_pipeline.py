"""Archive and upload inside the training pipeline, against a real Prefect server and a real S3 server.

- Policy: ``next_groups`` picks whole groups, oldest first, by count or size (pure tests).
- Consolidation: a run with ``archive.every=2`` leaves tarballs that GNU tar lists, with
  their indexes; the archived versions load bit for bit as the same run without archiving
  saved them; the jobs are Prefect task runs.
- Upload: the remote copy of a run (tarballs, and loose versions unless ``upload_versions`` is off)
  is a store of its own that lists and loads the versions; reading one epoch out of a
  tarball on S3 reads only that epoch's byte ranges.
- Crashes: a run SIGKILLed while it writes a tarball, uploads one, or uploads a loose
  version leaves every committed version loadable; running it again completes the job.
- ``ckptflow run``'s archive and upload flags reach the flow's config.

The crash tests plant the hang in the child process's storage library (see
``tests/children/hang_child.py``): the kill lands at a known point, not at a lucky one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from typer.testing import CliRunner

from ckptflow.storage import CheckpointStore, StoreOptions, VersionInfo
from ckptflow.storage.archive.tarballs import list_archived, list_tarballs
from ckptflow.storage.archive.tarindex import index_name
from ckptflow.storage.remote.etag import MiB
from ckptflow.storage.remote.transfer import upload_file
from ckptflow.tasks.archiving import next_groups
from ckptflow.tasks.config import ArchiveConfig
from ckptflow.tasks.reporting.formatting import human_size
from tests.children import hang_child
from tests.conftest import assert_same_state
from tests.pipeline.helpers import (
    REPO,
    Child,
    assert_only_committed,
    assert_same_checkpoint,
    make_config,
    open_store,
    poll,
    run_summary,
    task_runs,
    version_dirs,
)
from tests.pipeline.specs import MARKED_SPEC, SPEC_CONFIG

EPOCHS = 5
TAR_12 = "epochs-000001-000002.tar"
TAR_34 = "epochs-000003-000004.tar"


# -- helpers -----------------------------------------------------------------------------------


def info(version: int, size: int = 100) -> VersionInfo:
    return VersionInfo(version, version, None, {}, "2024-01-01T00:00:00Z", size, size, f"v{version}")


def archive_files(root: str | Path) -> list[str]:
    directory = Path(root) / "archive"
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def remote_options(endpoint: str) -> dict[str, Any]:
    """What a pipeline config may carry for S3: the endpoint, no credentials (those come from the env)."""
    return {"client_kwargs": {"endpoint_url": endpoint}}


def remote_store(url: str, endpoint: str) -> CheckpointStore:
    return CheckpointStore(url, storage_options={**remote_options(endpoint), "skip_instance_cache": True})


def s3_client(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def open_multipart_uploads(endpoint: str, bucket: str) -> list[str]:
    """Keys of the multipart uploads S3 still holds open in ``bucket``."""
    return [u["Key"] for u in s3_client(endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def archive_task_runs(flow_run_id: Any, expected: int) -> list[Any]:
    """The ``archive_versions`` task runs of a flow run, once the API holds ``expected`` final ones."""

    def read() -> list[Any]:
        return [t for t in task_runs(flow_run_id) if t.name.startswith("archive_versions-")]

    return poll(read, lambda rs: len(rs) == expected and all(t.state and t.state.is_final() for t in rs))


class ArchiveChild(Child):
    """``python -m tests.children.hang_child CONFIG``: a flow run with a hang planted in archiving."""

    def __init__(self, server: Any, config: Any, out: Path, **env: str) -> None:
        self.out = out
        with open(out, "wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.children.hang_child", config.model_dump_json()],
                cwd=REPO,
                env={**server.env(), **env},
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )


@pytest.fixture(scope="module")
def reference(prefect_server, tmp_path_factory) -> CheckpointStore:
    """The same run without archiving: what every archived version must load as, bit for bit."""
    config = make_config(tmp_path_factory.mktemp("reference") / "store", epochs=EPOCHS)
    run_summary(config)
    store = CheckpointStore(config.storage)
    assert [v.version for v in store.versions()] == list(range(1, EPOCHS + 1))
    return store


# -- policy ------------------------------------------------------------------------------------


class TestNextGroups:
    """Which loose versions the next archive jobs take: whole groups only, oldest first."""

    def test_every_k_takes_whole_groups_and_leaves_the_rest(self):
        loose = [info(v) for v in range(1, 8)]
        assert next_groups(loose, ArchiveConfig(every=2), set()) == [[1, 2], [3, 4], [5, 6]]
        assert next_groups(loose, ArchiveConfig(every=3), set()) == [[1, 2, 3], [4, 5, 6]]
        assert next_groups(loose, ArchiveConfig(every=1), set()) == [[v] for v in range(1, 8)]
        assert next_groups(loose, ArchiveConfig(every=8), set()) == []

    def test_target_bytes_closes_a_group_once_it_reaches_the_size(self):
        loose = [info(1, 40), info(2, 40), info(3, 40), info(4, 100), info(5, 30), info(6, 30)]
        config = ArchiveConfig(target_bytes=100)
        assert next_groups(loose, config, set()) == [[1, 2, 3], [4]]  # 120 >= 100; 100 >= 100; 60 waits
        assert next_groups(loose, ArchiveConfig(target_bytes=1), set()) == [[v] for v in range(1, 7)]
        assert next_groups(loose, ArchiveConfig(target_bytes=10**9), set()) == []

    def test_with_both_policies_the_first_one_reached_closes_the_group(self):
        loose = [info(1, 10), info(2, 10), info(3, 10), info(4, 60), info(5, 10), info(6, 10)]
        config = ArchiveConfig(every=3, target_bytes=50)
        # count first: 1,2,3 (30 bytes); size first: 4 (60 bytes); then 5,6 are two of three, 20 bytes
        assert next_groups(loose, config, set()) == [[1, 2, 3], [4]]

    def test_busy_versions_are_skipped(self):
        loose = [info(v) for v in range(1, 7)]
        config = ArchiveConfig(every=2)
        assert next_groups(loose, config, {1, 2}) == [[3, 4], [5, 6]]
        assert next_groups(loose, config, {1, 2, 3, 4}) == [[5, 6]]
        assert next_groups(loose, config, set(range(1, 7))) == []

    def test_groups_are_in_version_order_whatever_the_input_order(self):
        loose = [info(v) for v in (5, 2, 4, 1, 3)]
        assert next_groups(loose, ArchiveConfig(every=2), set()) == [[1, 2], [3, 4]]
        assert next_groups(loose, ArchiveConfig(target_bytes=300), set()) == [[1, 2, 3]]

    def test_no_policy_archives_nothing(self):
        assert next_groups([info(v) for v in range(1, 5)], ArchiveConfig(), set()) == []


class TestArchiveConfig:
    """The archive part of the flow's parameters: no credentials, nothing contradictory."""

    @pytest.mark.parametrize("options", [{"key": "AKIA"}, {"client_kwargs": {"aws_secret_access_key": "x"}}])
    def test_credentials_in_upload_options_are_refused(self, options):
        with pytest.raises(ValueError, match=r"archive\.upload_options must not hold credentials"):
            ArchiveConfig(upload_to="s3://b/run", upload_options=options)

    def test_upload_versions_needs_a_target(self):
        with pytest.raises(ValueError, match=r"upload_versions needs archive\.upload_to"):
            ArchiveConfig(upload_versions=True)

    def test_enabled_by_either_policy(self):
        assert not ArchiveConfig(upload_to="s3://b/run").enabled()
        assert ArchiveConfig(every=3).enabled() and ArchiveConfig(target_bytes=1 << 30).enabled()


# -- consolidation in the flow -----------------------------------------------------------------


@pytest.mark.prefect
class TestConsolidation:
    """``archive.every=2`` over 5 epochs: two tarballs, the fifth version loose, every version intact."""

    @pytest.mark.parametrize("keep_loose", [False, True], ids=["drop-loose", "keep-loose"])
    def test_tarballs_replace_the_loose_versions(self, prefect_server, reference, tmp_path, keep_loose):
        config = make_config(
            tmp_path / "store", epochs=EPOCHS, archive={"every": 2, "keep_loose": keep_loose}
        )
        summary, run_id = run_summary(config)
        assert summary["last_epoch"] == EPOCHS

        root = config.storage
        assert archive_files(root) == sorted([TAR_12, index_name(TAR_12), TAR_34, index_name(TAR_34)])
        loose = range(1, EPOCHS + 1) if keep_loose else [EPOCHS]
        assert version_dirs(root) == [f"v{v:06d}" for v in loose]

        store = CheckpointStore(root)
        listed = store.versions()
        assert [v.version for v in listed] == list(range(1, EPOCHS + 1))
        # a version with loose files is read from them; without, from its tarball
        assert [v.archived for v in listed] == [v not in loose for v in range(1, EPOCHS + 1)]
        archived = list_archived(store.loc)
        assert {v: a.tar for v, a in archived.items()} == {1: TAR_12, 2: TAR_12, 3: TAR_34, 4: TAR_34}
        for v in range(1, EPOCHS + 1):  # drop-loose: 1-4 can only come from the tarballs
            store.verify(v)
            assert_same_checkpoint(store, reference, v)

        for tar, versions in ((TAR_12, (1, 2)), (TAR_34, (3, 4))):  # GNU tar reads them
            listing = subprocess.run(
                ["tar", "-tf", str(Path(root) / "archive" / tar)], capture_output=True, text=True, check=True
            ).stdout.split()
            shards = {v: [s.file for s in store.manifest(v).shards] for v in versions}
            assert listing == [f"v{v:06d}/{name}" for v in versions for name in [*shards[v], "manifest.json"]]

        # The archive jobs are task runs of this flow run in the Prefect API, and they completed.
        runs = archive_task_runs(run_id, 2)
        assert len(runs) == 2, [(t.name, t.state_type) for t in runs]
        assert all(t.state.is_completed() for t in runs), [(t.name, t.state_type) for t in runs]

    def test_ckptflow_run_flags(self, prefect_server, tmp_path, monkeypatch):
        """``ckptflow run --archive-every/--keep-loose`` and ``--archive-size`` reach the flow's config."""
        from ckptflow.flows.cli import app

        monkeypatch.setenv("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")  # run sets it otherwise
        common = [
            "--epochs",
            "3",
            "--spec",
            MARKED_SPEC,
            "--spec-config",
            json.dumps(SPEC_CONFIG),
            "--shards",
            "2",
        ]
        every = tmp_path / "every"
        result = CliRunner().invoke(
            app, ["run", "--storage", str(every), *common, "--archive-every", "2", "--keep-loose"]
        )
        assert result.exit_code == 0, result.output
        assert archive_files(every) == [index_name(TAR_12), TAR_12]
        assert version_dirs(every) == ["v000001", "v000002", "v000003"]

        sized = tmp_path / "sized"
        result = CliRunner().invoke(app, ["run", "--storage", str(sized), *common, "--archive-size", "1B"])
        assert result.exit_code == 0, result.output
        tars = [f"epochs-{v:06d}-{v:06d}.tar" for v in (1, 2, 3)]  # each version reaches 1 byte alone
        assert archive_files(sized) == sorted([*tars, *map(index_name, tars)])
        assert version_dirs(sized) == []
        assert [v.archived for v in CheckpointStore(str(sized)).versions()] == [True] * 3

    @pytest.mark.s3
    def test_ckptflow_run_upload_flags(self, prefect_server, s3_server, s3_bucket, tmp_path, monkeypatch):
        """``--upload-to URL --upload-versions``; the endpoint and credentials come from the environment."""
        from ckptflow.flows.cli import app

        bucket, _ = s3_bucket
        monkeypatch.setenv("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server)  # botocore's own setting, read by s3fs
        args = ["run", "--storage", str(tmp_path / "store"), "--epochs", "3", "--spec", MARKED_SPEC]
        args += ["--spec-config", json.dumps(SPEC_CONFIG), "--shards", "2", "--archive-every", "2"]
        args += ["--upload-to", f"s3://{bucket}/run", "--upload-versions"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        remote = remote_store(f"s3://{bucket}/run", s3_server)
        assert [v.version for v in remote.versions()] == [1, 2, 3]
        assert sorted(list_archived(remote.loc)) == [1, 2]


# -- uploads -----------------------------------------------------------------------------------


def read_artifacts(flow_run_id: Any, key: str) -> list[Any]:
    """Every artifact of a flow run under ``key`` (each version of it, not only the newest)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])
            )
        )


def flow_run_name(flow_run_id: Any) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).name


@pytest.mark.prefect
@pytest.mark.s3
class TestUpload:
    """``upload_to`` S3 (SeaweedFS): the remote copy is a store that lists and loads the versions."""

    def test_uploaded_archives_form_a_loadable_store(
        self, prefect_server, reference, s3_server, s3_bucket, tmp_path
    ):
        bucket, _ = s3_bucket
        upload_to = f"s3://{bucket}/run"
        archive = {"every": 2, "upload_to": upload_to, "upload_options": remote_options(s3_server)}
        config = make_config(tmp_path / "store", epochs=EPOCHS, archive={**archive, "upload_versions": False})
        summary, run_id = run_summary(config)
        assert version_dirs(config.storage) == ["v000005"]  # 1-4 dropped, once their upload was verified
        assert summary["not_mirrored"] == [5]  # archives only: the loose version stays here

        remote = remote_store(upload_to, s3_server)
        listed = remote.versions()
        assert [(v.version, v.archived) for v in listed] == [(v, True) for v in range(1, 5)]
        for v in range(1, 5):
            remote.verify(v)
            assert_same_checkpoint(remote, reference, v)
        keys = sorted(o["Key"] for o in s3_client(s3_server).list_objects_v2(Bucket=bucket)["Contents"])
        assert keys == [
            *(f"run/archive/{n}" for n in sorted([TAR_12, index_name(TAR_12), TAR_34, index_name(TAR_34)])),
            "run/run.json",  # the run's identity: a resume from this durable tier is checked (issue 56)
            "run/store.json",  # the store it mirrors (issue 52)
        ]
        assert open_multipart_uploads(s3_server, bucket) == []

        # One link artifact per uploaded tarball, keyed by the flow run's name.
        key = f"ckptflow-{_slug(flow_run_name(run_id))}-upload"
        links = poll(lambda: read_artifacts(run_id, key), lambda found: len(found) == 2)
        sizes = {a.tar: human_size(a.index.size) for a in list_archived(open_store(config).loc).values()}
        assert sorted(str(a.data) for a in links) == [
            f"{tar} ({sizes[tar]}): `{upload_to}/archive/{tar}`" for tar in (TAR_12, TAR_34)
        ]

    def test_upload_versions_mirrors_each_loose_version_manifest_last(
        self, prefect_server, reference, s3_server, s3_bucket, tmp_path, monkeypatch
    ):
        from ckptflow.storage.remote import transfer

        sent: list[str] = []
        lock = threading.Lock()

        def recording_upload(local_path, url, **kwargs):
            with lock:
                sent.append(url)
            return upload_file(local_path, url, **kwargs)

        monkeypatch.setattr(transfer, "upload_file", recording_upload)
        bucket, _ = s3_bucket
        upload_to = f"s3://{bucket}/run"
        config = make_config(
            tmp_path / "store",
            epochs=3,
            archive={
                "every": 2,
                "upload_to": upload_to,
                "upload_options": remote_options(s3_server),
                "upload_versions": True,
            },
        )
        run_summary(config)

        remote = remote_store(upload_to, s3_server)
        assert [v.version for v in remote.versions()] == [1, 2, 3]
        assert sorted(list_archived(remote.loc)) == [1, 2]
        for v in (1, 2, 3):
            assert_same_checkpoint(remote, reference, v)
        for v in (1, 2, 3):  # the shards of each version, then its manifest (the remote commit)
            mine = [u.rsplit("/", 1)[-1] for u in sent if f"/run/v{v:06d}/" in u]
            shards = [s.file for s in CheckpointStore(config.storage).manifest(v).shards]
            assert sorted(mine[:-1]) == sorted(shards) and mine[-1] == "manifest.json", mine
        assert open_multipart_uploads(s3_server, bucket) == []

    def test_a_version_upload_finishes_before_archiving_drops_its_files(
        self, prefect_server, s3_server, s3_bucket, tmp_path, monkeypatch
    ):
        """Bug fix: with ``upload_versions``, the archive job of a version ran beside its upload job.

        It could remove the loose files while the upload still read them; the upload then failed
        (FileNotFoundError, after its retries) and so did the run. An archive job now waits for the
        upload jobs of its versions. Here version uploads are slow, so the archive job comes first.
        """
        from ckptflow.storage.remote import transfer

        def slow_version_upload(local_path, url, **kwargs):
            if "/archive/" not in url:
                time.sleep(0.5)
            return upload_file(local_path, url, **kwargs)

        monkeypatch.setattr(transfer, "upload_file", slow_version_upload)
        bucket, _ = s3_bucket
        upload_to = f"s3://{bucket}/run"
        config = make_config(
            tmp_path / "store",
            epochs=2,
            archive={
                "every": 1,
                "upload_to": upload_to,
                "upload_options": remote_options(s3_server),
                "upload_versions": True,
            },
        )
        run_summary(config)
        assert version_dirs(config.storage) == []
        remote = remote_store(upload_to, s3_server)
        assert [v.version for v in remote.versions()] == [1, 2]
        local = CheckpointStore(config.storage)
        for v in (1, 2):  # each version twice on the remote: its own directory, and a tarball
            names = remote.loc.fs.ls(remote.loc.path(f"v{v:06d}"), detail=False)
            shards = [s.file for s in local.manifest(v).shards]
            assert sorted(n.rsplit("/", 1)[-1] for n in names) == sorted([*shards, "manifest.json"])
            assert_same_state(remote.load(v), local.load(v))
        assert sorted(list_archived(remote.loc)) == [1, 2]


# -- range reads -------------------------------------------------------------------------------


class ByteCounter:
    """Counts the bytes s3fs hands back from GET requests (whole objects and ranges)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import s3fs.core

        self.total = 0
        self.requests = 0
        self._lock = threading.Lock()
        cat_file, fetch_range = s3fs.core.S3FileSystem._cat_file, s3fs.core._fetch_range

        async def counted_cat_file(fs, path, *args, **kwargs):
            return self._count(await cat_file(fs, path, *args, **kwargs))

        async def counted_fetch_range(*args, **kwargs):
            return self._count(await fetch_range(*args, **kwargs))

        monkeypatch.setattr(s3fs.core.S3FileSystem, "_cat_file", counted_cat_file)
        monkeypatch.setattr(s3fs.core, "_fetch_range", counted_fetch_range)

    def _count(self, data: bytes) -> bytes:
        with self._lock:
            self.total += len(data)
            self.requests += 1
        return data


@pytest.mark.s3
def test_one_epoch_of_a_ten_epoch_tarball_on_s3_reads_only_its_ranges(
    s3_server, s3_bucket, tmp_path, monkeypatch
):
    bucket, options = s3_bucket
    local = CheckpointStore(str(tmp_path / "store"), options=StoreOptions(shards=2, threads=2))
    states = {}
    for epoch in range(1, 11):
        torch.manual_seed(epoch)
        states[epoch] = {"w": torch.randn(256 * 1024), "b": torch.randn(1000).to(torch.bfloat16)}
        local.save(states[epoch], epoch=epoch, version=epoch)
    index = local.archive(list(range(1, 11)))
    assert index.tar == "epochs-000001-000010.tar"
    for name in (index.tar, index_name(index.tar)):
        upload_file(
            tmp_path / "store" / "archive" / name,
            f"s3://{bucket}/run/archive/{name}",
            storage_options=options,
        )

    counter = ByteCounter(monkeypatch)  # before the store's filesystem binds its sync methods
    remote = CheckpointStore(f"s3://{bucket}/run", storage_options=options)
    listed = remote.versions()
    assert [(v.version, v.archived) for v in listed] == [(v, True) for v in range(1, 11)]
    listing_bytes = counter.total
    state = remote.load(5)
    assert_same_state(state, states[5])

    read = counter.total - listing_bytes
    epoch_size = local.info(5).size
    assert epoch_size <= read < epoch_size + 2 * MiB // 8, (read, epoch_size)  # its shards (and an index)
    assert counter.total < index.size / 5, (counter.total, index.size)


# -- crashes -----------------------------------------------------------------------------------


@pytest.mark.prefect
@pytest.mark.crash
class TestCrashes:
    """SIGKILL in the middle of a background job: nothing committed is lost, a re-run finishes the job."""

    @pytest.mark.parametrize("collect_first", [True, False], ids=["gc-then-rerun", "rerun"])
    def test_killed_while_writing_a_tarball(self, prefect_server, reference, tmp_path, collect_first):
        """Test fix (failed CI once): the job of 3-4 can start its tarball before the kill lands.

        The test took the tarball of 1-2 as the only partial one; archive jobs run side by side.
        """
        config = make_config(tmp_path / "store", epochs=4, archive={"every": 2})
        markers = tmp_path / "markers"
        markers.mkdir()
        child = ArchiveChild(
            prefect_server, config, tmp_path / "child.log", **{hang_child.HANG_IN_TAR_ENV: str(markers)}
        )
        try:
            child.wait_for(lambda: (markers / hang_child.TAR_MARKER).exists(), 120, "a tarball being written")
        finally:
            child.kill()
        assert child.proc.returncode == -9
        first = (markers / hang_child.TAR_MARKER).read_text()
        assert first in (TAR_12, TAR_34)

        # Half a tar, no index: every committed version loads from its loose files. Archive jobs
        # run side by side, so the job of 3-4 may have begun its own tarball (and hang) as well.
        root = Path(config.storage)
        partials = archive_files(root)
        assert first in partials and set(partials) <= {TAR_12, TAR_34}, partials
        assert (root / "archive" / first).stat().st_size > 0
        store = CheckpointStore(str(root))
        assert list_tarballs(store.loc) == ([], partials)
        committed = assert_only_committed(root, garbage_allowed=True)
        assert committed[:2] == [1, 2], committed
        assert not any(v.archived for v in store.versions())
        assert list_archived(store.loc) == {}
        if collect_first:
            store.gc()
            assert archive_files(root) == []
            assert assert_only_committed(root, garbage_allowed=True) == committed

        summary, _ = run_summary(config)  # the re-run catches up: 1-2 were due before it started
        assert summary["last_epoch"] == 4
        assert archive_files(root) == sorted([TAR_12, index_name(TAR_12), TAR_34, index_name(TAR_34)])
        assert version_dirs(root) == []
        store = CheckpointStore(str(root))
        assert [(v.version, v.archived) for v in store.versions()] == [(v, True) for v in range(1, 5)]
        for v in range(1, 5):
            store.verify(v)
            assert_same_checkpoint(store, reference, v)

    @pytest.mark.s3
    def test_killed_while_uploading_a_tarball(self, prefect_server, s3_server, s3_bucket, tmp_path):
        bucket, _ = s3_bucket
        upload_to = f"s3://{bucket}/run"
        # hidden=4096: about 3.7 MB a version, so the first tarball goes up in two 5 MiB parts
        config = make_config(
            tmp_path / "store",
            epochs=4,
            spec_config={**SPEC_CONFIG, "hidden": 4096},
            archive={
                "every": 2,
                "upload_to": upload_to,
                "upload_options": remote_options(s3_server),
                "upload_versions": False,  # the tarballs only: their upload is what is cut off
            },
        )
        markers = tmp_path / "markers"
        markers.mkdir()
        child = ArchiveChild(
            prefect_server, config, tmp_path / "child.log", **{hang_child.HANG_IN_UPLOAD_ENV: str(markers)}
        )
        tar_key = f"run/archive/{TAR_12}"
        try:
            child.wait_for(lambda: (markers / hang_child.UPLOAD_MARKER).exists(), 120, "an upload under way")
            first = (markers / hang_child.UPLOAD_MARKER).read_text()  # 1-2's, unless 3-4 overtook it
            assert first in [f"{bucket}/run/archive/{tar}" for tar in (TAR_12, TAR_34)]
            key = first.split("/", 1)[1]
            assert key in open_multipart_uploads(s3_server, bucket)  # part 1 sent, not completed
        finally:
            child.kill()
        assert child.proc.returncode == -9

        # The tarball is committed here, its upload is not: the loose copies stay, everything loads.
        root = Path(config.storage)
        assert {TAR_12, index_name(TAR_12)} <= set(archive_files(root))
        committed = assert_only_committed(root, garbage_allowed=True)
        assert committed[:2] == [1, 2] and {"v000001", "v000002"} <= set(version_dirs(root))
        remote = remote_store(upload_to, s3_server)
        assert remote.versions() == []  # no object, and above all no index, for a partial upload
        local = CheckpointStore(str(root))

        summary, _ = run_summary(config)
        assert summary["last_epoch"] == 4
        assert version_dirs(root) == []
        assert open_multipart_uploads(s3_server, bucket) == []  # the abandoned upload was aborted
        remote = remote_store(upload_to, s3_server)
        assert [(v.version, v.archived) for v in remote.versions()] == [(v, True) for v in range(1, 5)]
        for v in range(1, 5):
            remote.verify(v)
            assert_same_state(remote.load(v), local.load(v))
        head = s3_client(s3_server).head_object(Bucket=bucket, Key=tar_key)
        assert head["ContentLength"] == (root / "archive" / TAR_12).stat().st_size

    @pytest.mark.s3
    def test_killed_while_uploading_a_version(self, prefect_server, s3_server, s3_bucket, tmp_path):
        """Bug fix: a version whose upload (``upload_versions``) a crash cut off was never uploaded.

        Only versions committed by the running run were uploaded, so the re-run left the mirror
        without it for good. A run now starts by uploading the loose versions the mirror lacks.
        """
        bucket, _ = s3_bucket
        upload_to = f"s3://{bucket}/run"
        config = make_config(
            tmp_path / "store",
            epochs=3,
            archive={
                "upload_to": upload_to,
                "upload_options": remote_options(s3_server),
                "upload_versions": True,
            },
        )
        markers = tmp_path / "markers"
        markers.mkdir()
        child = ArchiveChild(
            prefect_server,
            config,
            tmp_path / "child.log",
            **{hang_child.HANG_IN_VERSION_UPLOAD_ENV: str(markers)},
        )
        marker = markers / hang_child.VERSION_UPLOAD_MARKER
        try:
            child.wait_for(marker.exists, 120, "a version upload under way")
        finally:
            child.kill()
        committed = assert_only_committed(config.storage, garbage_allowed=True)
        assert marker.read_text() in [f"{upload_to}/v{v:06d}/manifest.json" for v in committed]
        remote = remote_store(upload_to, s3_server)
        assert remote.versions() == []  # every upload stopped before its manifest: no version there

        run_summary(config)
        remote = remote_store(upload_to, s3_server)
        local = CheckpointStore(config.storage)
        assert [v.version for v in remote.versions()] == [1, 2, 3]
        for v in (1, 2, 3):
            assert_same_state(remote.load(v), local.load(v))


def _slug(text: str) -> str:
    from ckptflow.tasks.reporting.monitoring import slug

    return slug(text)


@pytest.mark.prefect
@pytest.mark.s3
def test_maintenance_archives_and_uploads_a_store_trained_without_archiving(
    prefect_server, reference, s3_server, s3_bucket, tmp_path
):
    """The maintenance flow applies the archive policy to the loose versions a store already holds."""
    from ckptflow.flows.maintenance import maintain_stores

    config = make_config(tmp_path / "store", epochs=EPOCHS)
    run_summary(config)
    assert version_dirs(config.storage) == [f"v{v:06d}" for v in range(1, EPOCHS + 1)]
    bucket, _ = s3_bucket
    upload_to = f"s3://{bucket}/mirror"
    archive = {"every": 2, "upload_to": upload_to, "upload_options": remote_options(s3_server)}

    report = maintain_stores({"storages": [config.storage], "archive": archive, "publish": False})
    assert report[0]["archived"] == [[1, 2], [3, 4]]
    assert report[0]["uploaded"] == [f"{upload_to}/archive/{TAR_12}", f"{upload_to}/archive/{TAR_34}"]
    assert version_dirs(config.storage) == ["v000005"]  # 1-4 dropped once their upload was verified
    store = CheckpointStore(config.storage)
    assert [(v.version, v.archived) for v in store.versions()] == [
        (1, True),
        (2, True),
        (3, True),
        (4, True),
        (5, False),
    ]
    remote = remote_store(upload_to, s3_server)  # every version: loose ones go up by default
    assert [v.version for v in remote.versions()] == [1, 2, 3, 4, 5]
    assert sorted(list_archived(remote.loc)) == [1, 2, 3, 4]
    for v in range(1, EPOCHS + 1):
        assert_same_checkpoint(store, reference, v)
        remote.verify(v)

    again = maintain_stores({"storages": [config.storage], "archive": archive, "publish": False})
    assert again[0]["archived"] == [] and version_dirs(config.storage) == ["v000005"]  # nothing new is due
