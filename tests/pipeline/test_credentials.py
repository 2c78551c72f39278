"""Credentials from Prefect blocks: a prefect-aws ``AwsCredentials`` block gives a run its S3 keys.

``storage_secret`` / ``archive.upload_secret`` name a block: ``NAME`` (a Secret
block of JSON fsspec options) or ``aws-credentials/NAME``. The runs here take
the AWS variables out of their environment, so S3 works only if the block's
keys and endpoint are used; and the keys must not reach the run's
parameters, logs or artifacts.
"""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogHandler
from prefect_aws import AwsCredentials
from pydantic import ValidationError

from ckptflow.storage import CheckpointStore
from ckptflow.storage.archive.tarballs import list_archived
from ckptflow.tasks.config import ArchiveConfig, PipelineConfig
from ckptflow.tasks.credentials import aws_credentials_options, with_secret
from tests.conftest import AWS_ENV, S3_KEY, S3_SECRET
from tests.pipeline.helpers import make_config, poll, run_summary
from tests.pipeline.specs import FAULTY_SPEC, MARKERS_ENV

BLOCK = "ckptflow-test-aws"
AWS_VARIABLES = (*AWS_ENV, "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION")


@pytest.fixture
def no_aws_environment(monkeypatch, tmp_path) -> None:
    """No keys, profile or endpoint in the environment, no files or instance metadata to fall back on."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


class TestBlockToOptions:
    def test_keys_region_and_endpoint_become_s3fs_options(self):
        block = AwsCredentials(
            aws_access_key_id="AKIDEXAMPLE",
            aws_secret_access_key="wJalrXUtnFEMI",
            aws_session_token="session-token",
            region_name="eu-west-1",
            aws_client_parameters={"endpoint_url": "http://127.0.0.1:9000", "verify": False},
        )
        assert aws_credentials_options(block, "b") == {
            "key": "AKIDEXAMPLE",
            "secret": "wJalrXUtnFEMI",
            "token": "session-token",
            "endpoint_url": "http://127.0.0.1:9000",
            "client_kwargs": {"region_name": "eu-west-1", "verify": False},
        }

    def test_a_profile_is_passed_on_so_its_credentials_refresh(
        self, no_aws_environment, tmp_path, monkeypatch
    ):
        """Not its keys, which would be frozen (tests/storage/test_s3_credentials.py shows a profile's
        expiring credentials fetched again)."""
        credentials = tmp_path / "credentials"
        credentials.write_text(
            "[training]\naws_access_key_id = AKIDPROFILE\naws_secret_access_key = from-file\n"
        )
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
        options = aws_credentials_options(AwsCredentials(profile_name="training"), "b")
        assert options == {"profile": "training"}
        keyed = AwsCredentials(profile_name="training", aws_access_key_id="AKID", aws_secret_access_key="s")
        assert aws_credentials_options(keyed, "b") == {
            "key": "AKID",
            "secret": "s",
        }  # the block's own keys win

    def test_a_block_that_resolves_to_no_keys_is_a_clear_error(self, no_aws_environment):
        with pytest.raises(ValueError, match="the AwsCredentials block 'empty' resolves to no credentials"):
            aws_credentials_options(AwsCredentials(), "empty")


class TestBlockReferences:
    @pytest.mark.parametrize("ref", ["gcp-credentials/x", "aws-credentials/", "secret/", "a/b/c"])
    def test_a_reference_to_another_kind_of_block_fails_validation(self, ref):
        with pytest.raises(ValidationError, match=r"storage_secret .* must name a Prefect block"):
            PipelineConfig(storage="ckpt", storage_secret=ref)
        with pytest.raises(ValidationError, match=r"archive.upload_secret .* must name a Prefect block"):
            ArchiveConfig(upload_to="s3://b/run", upload_secret=ref)

    @pytest.mark.parametrize("ref", ["creds", "secret/creds", "aws-credentials/creds"])
    def test_block_references_that_are_accepted(self, ref):
        assert PipelineConfig(storage="ckpt", storage_secret=ref).storage_secret == ref


@pytest.mark.prefect
@pytest.mark.s3
class TestPipelineWithAwsCredentialsBlock:
    @pytest.fixture
    def block(self, prefect_server, s3_server) -> str:
        AwsCredentials(
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
            region_name="us-east-1",
            aws_client_parameters={"endpoint_url": s3_server},
        ).save(BLOCK, overwrite=True)
        return f"aws-credentials/{BLOCK}"

    def test_with_secret_reads_the_saved_block(self, block, s3_server):
        merged = with_secret({"skip_instance_cache": True, "client_kwargs": {"verify": False}}, block)
        assert merged == {
            "skip_instance_cache": True,
            "key": S3_KEY,
            "secret": S3_SECRET,
            "endpoint_url": s3_server,
            "client_kwargs": {"verify": False, "region_name": "us-east-1"},
        }

    def test_checkpoints_go_to_s3_with_the_blocks_keys(self, block, s3_bucket, no_aws_environment):
        bucket, options = s3_bucket
        config = make_config(f"s3://{bucket}/run", epochs=2, storage_secret=block)
        summary, run_id = run_summary(config)
        assert summary["last_epoch"] == 2

        store = CheckpointStore(f"s3://{bucket}/run", storage_options=options)
        assert [v.version for v in store.versions()] == [1, 2]
        store.verify(2)
        assert store.load(2)["progress"]["epoch"] == 2
        assert_secret_absent(run_id)

    def test_a_training_process_started_early_gets_the_blocks_keys_from_the_flow(
        self, block, s3_bucket, tmp_path, monkeypatch, no_aws_environment
    ):
        """``ckptflow run`` starts its training process before anything can resolve a block; the
        flow's init gives it its job, with the block's keys, on its stdin (never its environment)."""
        from ckptflow.tasks.training import trainer

        markers = tmp_path / "markers"
        markers.mkdir()
        monkeypatch.setenv(MARKERS_ENV, str(markers))
        trainer.spawn_early()
        assert trainer._spare is not None
        early = trainer._spare.pid
        bucket, options = s3_bucket
        config = make_config(
            f"s3://{bucket}/early", spec=FAULTY_SPEC, epochs=2, storage_secret=block, train_process=True
        )
        trainer.prestart(config)  # as the CLI does: a block waits for the flow
        assert trainer._spare is not None and trainer._prestarted is None
        summary, run_id = run_summary(config)

        assert summary["last_epoch"] == 2
        parents = {int(line.split()[2]) for line in (markers / "attempts").read_text().splitlines()}
        assert parents == {early}, f"epochs ran in ranks of {parents}, not of the early launcher {early}"
        assert trainer._spare is None
        store = CheckpointStore(f"s3://{bucket}/early", storage_options=options)
        assert [v.version for v in store.versions()] == [1, 2]
        assert_secret_absent(run_id)

    def test_archives_are_uploaded_with_the_blocks_keys(self, block, s3_bucket, tmp_path, no_aws_environment):
        bucket, options = s3_bucket
        config = make_config(
            tmp_path / "store",
            epochs=2,
            archive={"every": 2, "upload_to": f"s3://{bucket}/mirror", "upload_secret": block},
        )
        summary, run_id = run_summary(config)
        assert summary["last_epoch"] == 2

        mirror = CheckpointStore(f"s3://{bucket}/mirror", storage_options=options)
        assert [v.version for v in mirror.versions()] == [1, 2]  # loose copies (by default) and a tarball
        assert sorted(list_archived(mirror.loc)) == [1, 2]
        mirror.verify(1)
        assert_secret_absent(run_id)


def assert_secret_absent(run_id: UUID) -> None:
    """The block's secret key is in none of the run's parameters, logs and artifacts."""
    APILogHandler().flush()  # run logs are shipped in batches: send what is still buffered
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        logs = poll(
            lambda: client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))),
            lambda found: any("stopped: reached epoch" in log.message for log in found),
        )
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    texts: list[Any] = [json.dumps(run.parameters), *(log.message for log in logs)]
    texts += [json.dumps(a.data) if not isinstance(a.data, str) else a.data for a in artifacts]
    texts += [a.description or "" for a in artifacts]
    assert logs and artifacts  # something to search in
    assert not [t for t in texts if S3_SECRET in t]
    assert not [t for t in texts if S3_KEY in t]
