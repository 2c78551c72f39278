"""An assumed IAM role (``assume_role`` in the storage options): its credentials sign every S3
request of a store and of the transfers, and are assumed again before they expire.

On moto: the point is AWS's STS (AssumeRole and the temporary keys it hands out), which the
real server of the other tests (SeaweedFS) does not offer. moto gives every AssumeRole new
keys; a role asked for 900 s (STS's least) is inside botocore's 15-minute refresh window from
the start, so each use of the credentials assumes the role again, as a long job's would each
time its hour runs out. Requests are observed on the clients' own event hooks.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from prefect_aws import AwsCredentials

from ckptflow.storage import CheckpointStore, StorageUnavailableError
from ckptflow.storage.remote.s3 import transfer_client
from ckptflow.storage.remote.s3client import forget_clients
from ckptflow.storage.remote.transfer import TransferOptions, download_file, upload_file
from ckptflow.tasks.credentials import aws_credentials_options
from tests.conftest import S3_KEY, S3_SECRET

pytestmark = pytest.mark.s3

ROLE = "arn:aws:iam::123456789012:role/training"
SIGNED_BY = re.compile(r"Credential=([A-Z0-9]+)/")


@pytest.fixture
def role_options(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Options for a fresh moto bucket through the role, assumed with the tests' own keys."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", moto_server)  # botocore's way to name STS's endpoint
    bucket = f"role-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3", endpoint_url=moto_server, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET
    ).create_bucket(Bucket=bucket)
    forget_clients()
    return {
        "bucket": bucket,
        "key": S3_KEY,
        "secret": S3_SECRET,
        "assume_role": {"RoleArn": ROLE, "DurationSeconds": 900},
        "client_kwargs": {"endpoint_url": moto_server, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


def signers(events: Any) -> list[str]:
    """Record the access key that signs each S3 request made through a client's ``events``."""
    seen: list[str] = []

    def record(request: Any, **_: Any) -> None:
        match = SIGNED_BY.search(str(request.headers.get("Authorization", b""), "ascii", "replace"))
        if match:
            seen.append(match.group(1))

    events.register("before-send.s3", record)
    return seen


def test_a_store_signs_with_the_role_and_assumes_it_again(role_options: dict[str, Any]) -> None:
    options = dict(role_options)
    bucket = options.pop("bucket")
    store = CheckpointStore(f"s3://{bucket}/run", storage_options=options)
    store.loc.fs.connect()
    seen = signers(store.loc.fs.s3.meta.events)
    store.save({"w": torch.arange(6.0)}, epoch=1)
    store.save({"w": torch.arange(6.0) * 2}, epoch=2)
    assert torch.equal(store.load(1)["w"], torch.arange(6.0))
    assert torch.equal(store.load()["w"], torch.arange(6.0) * 2)
    assert len(seen) >= 4 and S3_KEY not in seen  # never the source keys: the role's
    assert len(set(seen)) > 1  # assumed again as its credentials neared their end


def test_transfers_sign_with_the_role_and_assume_it_again(
    role_options: dict[str, Any], tmp_path: Path
) -> None:
    options = dict(role_options)
    bucket = options.pop("bucket")
    transfer = TransferOptions()
    seen = signers(transfer_client(options, transfer).meta.events)
    src = tmp_path / "src"
    src.write_bytes(b"role" * 4096)
    upload_file(src, f"s3://{bucket}/a", storage_options=options, options=transfer)
    download_file(f"s3://{bucket}/a", tmp_path / "back", storage_options=options, options=transfer)
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    assert seen and S3_KEY not in seen, "the transfers' client is the one observed, signing as the role"
    assert len(set(seen)) > 1


def test_an_aws_credentials_block_with_a_role_passes_the_role_on(role_options: dict[str, Any]) -> None:
    """Regression: the block's role was assumed once and its keys frozen into the options, which
    stopped working an hour into a run. Now the options carry the role and the block's own keys."""
    block = AwsCredentials(
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
        region_name="us-east-1",
        assume_role_arn=ROLE,
        assume_role_kwargs={"DurationSeconds": 900, "RoleSessionName": "train-7"},
    )
    options = aws_credentials_options(block, "b")
    assert options == {
        "key": S3_KEY,
        "secret": S3_SECRET,
        "assume_role": {"RoleArn": ROLE, "DurationSeconds": 900, "RoleSessionName": "train-7"},
        "client_kwargs": {"region_name": "us-east-1"},
    }
    bucket = role_options["bucket"]
    endpoint = role_options["client_kwargs"]["endpoint_url"]
    store = CheckpointStore(
        f"s3://{bucket}/block",
        storage_options={**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": endpoint}},
    )
    store.save({"w": torch.ones(3)}, epoch=1)
    assert torch.equal(store.load()["w"], torch.ones(3))


def test_an_mfa_role_is_assumed_once_and_its_keys_frozen(role_options: dict[str, Any]) -> None:
    """A TokenCode serves once: those keys cannot be refreshed, so they are frozen as before."""
    block = AwsCredentials(
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
        assume_role_arn=ROLE,
        assume_role_kwargs={"SerialNumber": "arn:aws:iam::123456789012:mfa/u", "TokenCode": "123456"},
    )
    options = aws_credentials_options(block, "b")
    assert "assume_role" not in options and options["key"] != S3_KEY and options["token"]


def test_a_role_with_an_mfa_device_is_refused_in_options(role_options: dict[str, Any]) -> None:
    """Assumed again unattended, it would ask for a code on the terminal (botocore's MFA prompt)."""
    options = {**role_options, "assume_role": {"RoleArn": ROLE, "SerialNumber": "arn:aws:iam::1:mfa/u"}}
    bucket = options.pop("bucket")
    with pytest.raises(StorageUnavailableError, match=r"names an MFA device .* assume it yourself"):
        CheckpointStore(f"s3://{bucket}/mfa", storage_options=options)


@pytest.mark.parametrize("role", ["arn:aws:iam::1:role/x", {"DurationSeconds": 900}, {"RoleArn": ""}])
def test_an_assume_role_without_a_role_arn_is_a_clear_error(role: Any, role_options: dict[str, Any]) -> None:
    options = {**role_options, "assume_role": role}
    bucket = options.pop("bucket")
    with pytest.raises(StorageUnavailableError, match=r"assume_role must be an object with a RoleArn"):
        CheckpointStore(f"s3://{bucket}/bad", storage_options=options)


def test_stores_opened_with_the_same_role_share_one_filesystem(role_options: dict[str, Any]) -> None:
    """fsspec caches filesystems by their options: a new role session per open would add one
    filesystem (and its connections) to that cache each time a run opens its store."""
    options = {k: v for k, v in role_options.items() if k not in ("bucket", "skip_instance_cache")}
    bucket = role_options["bucket"]
    first = CheckpointStore(f"s3://{bucket}/a", storage_options=options)
    second = CheckpointStore(f"s3://{bucket}/b", storage_options=dict(options))
    assert first.loc.fs is second.loc.fs
    first.save({"w": torch.ones(2)}, epoch=1)
    assert second.versions() == [] and torch.equal(
        CheckpointStore(f"s3://{bucket}/a", storage_options=options).load()["w"], torch.ones(2)
    )
