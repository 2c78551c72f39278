"""A real S3 server that checks credentials: SeaweedFS configured with one access key.

The session's server (tests/conftest.py) accepts any keys; this one, started for this module,
refuses every key but its own, as S3 does, so the error a user sees for wrong credentials is
the one tested here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

from ckptflow.storage import CheckpointStore, StorageUnavailableError
from ckptflow.storage.remote.transfer import download_file, upload_file
from tests.seaweed import start_seaweed

pytestmark = pytest.mark.s3

KEY, SECRET = "ckpt-admin", "ckpt-right-secret-5e1d"
BUCKET = "ckpt-creds"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start_seaweed(tmp_path_factory.mktemp("seaweedfs-keys"), access_key=KEY, secret_key=SECRET)
    try:
        client = boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=BUCKET)
        yield server.endpoint
    finally:
        server.stop()


def options(endpoint: str, key: str, secret: str) -> dict[str, Any]:
    return {
        "key": key,
        "secret": secret,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


def profile_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: str, profile: str, credential_process: str
) -> dict[str, Any]:
    """Storage options naming ``profile``, the only credentials around: an AWS config file in which
    ``credential_process`` gives its keys, no credentials file, no keys in the environment."""
    config = tmp_path / "config"
    config.write_text(f"[profile {profile}]\ncredential_process = {credential_process}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    return {"profile": profile, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def test_the_right_keys_save_and_load(keyed_server: str) -> None:
    store = CheckpointStore(f"s3://{BUCKET}/right", storage_options=options(keyed_server, KEY, SECRET))
    store.save({"w": torch.arange(4.0)}, epoch=1)
    assert torch.equal(store.load()["w"], torch.arange(4.0))


@pytest.mark.parametrize(
    ("key", "secret"), [(KEY, "a-wrong-secret-77"), ("nobody", "a-wrong-secret-77")], ids=["secret", "key"]
)
def test_wrong_credentials_are_refused_with_a_clear_error(keyed_server: str, key: str, secret: str) -> None:
    url = f"s3://{BUCKET}/wrong"
    with pytest.raises(StorageUnavailableError) as caught:
        CheckpointStore(url, storage_options=options(keyed_server, key, secret)).save(
            {"w": torch.ones(2)}, epoch=1
        )
    message = str(caught.value)
    assert "refused the credentials" in message and "AWS_ACCESS_KEY_ID" in message and url in message
    assert "a-wrong-secret-77" not in message
    right = CheckpointStore(url, storage_options=options(keyed_server, KEY, SECRET))
    assert right.versions() == []  # nothing was written with the wrong keys


def test_wrong_credentials_refuse_a_transfer_with_the_stores_message(
    keyed_server: str, tmp_path: Path
) -> None:
    """Uploads and downloads (boto3's client) say what the store says, naming the endpoint."""
    src = tmp_path / "src"
    src.write_bytes(b"ckpt" * 1000)
    url = f"s3://{BUCKET}/transfer/a"
    upload_file(src, url, storage_options=options(keyed_server, KEY, SECRET))
    wrong = options(keyed_server, KEY, "a-wrong-secret-77")
    for move in (
        lambda: upload_file(src, url, storage_options=wrong),
        lambda: download_file(url, tmp_path / "back", storage_options=wrong),
    ):
        with pytest.raises(StorageUnavailableError) as caught:
            move()
        message = str(caught.value)
        assert f"the object store at {keyed_server} refused the credentials" in message, message
        assert url in message and "AWS_ACCESS_KEY_ID" in message and "a-wrong-secret-77" not in message
    assert not (tmp_path / "back").exists()


def test_a_profile_whose_credentials_cannot_be_fetched_says_so(
    keyed_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile whose credential_process fails: the store and the transfers name the profile's
    failure (not "no credentials"), and nothing raw from botocore reaches the caller."""
    so = profile_options(
        monkeypatch, tmp_path, keyed_server, "broken", f"{sys.executable} -c 'raise SystemExit(3)'"
    )
    src = tmp_path / "src"
    src.write_bytes(b"ckpt")
    url = f"s3://{BUCKET}/broken/a"
    for move in (
        lambda: upload_file(src, url, storage_options=so),
        lambda: download_file(url, tmp_path / "back", storage_options=so),
        lambda: CheckpointStore(f"s3://{BUCKET}/broken", storage_options=so).save(
            {"w": torch.ones(2)}, epoch=1
        ),
    ):
        with pytest.raises(StorageUnavailableError) as caught:
            move()
        message = str(caught.value)
        assert "could not get credentials for s3://" in message and "credential_process" in message, message


_CREDENTIAL_PROCESS = """
import datetime, json, pathlib, sys
calls = pathlib.Path(sys.argv[1])
calls.write_text(calls.read_text() + "x" if calls.exists() else "x")
expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)
print(json.dumps({"Version": 1, "AccessKeyId": sys.argv[2], "SecretAccessKey": sys.argv[3],
                  "Expiration": expires.isoformat()}))
"""


def test_expiring_credentials_of_a_profile_are_fetched_again(
    keyed_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile (what an AwsCredentials block naming one passes on) whose credentials expire in
    5 minutes, within botocore's refresh window: each transfer, and the store, get fresh ones
    instead of keys frozen when the options were built."""
    calls, script = tmp_path / "calls", tmp_path / "creds.py"
    script.write_text(_CREDENTIAL_PROCESS)
    process = f"{sys.executable} {script} {calls} {KEY} {SECRET}"
    so = profile_options(monkeypatch, tmp_path, keyed_server, "job", process)
    src = tmp_path / "src"
    src.write_bytes(b"ckpt" * 1000)
    upload_file(src, f"s3://{BUCKET}/profile/a", storage_options=so)
    fetched = len(calls.read_text())
    download_file(f"s3://{BUCKET}/profile/a", tmp_path / "back", storage_options=so)
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    assert len(calls.read_text()) > fetched  # asked again: the keys were about to expire
    store = CheckpointStore(
        f"s3://{BUCKET}/profile/store", storage_options={**so, "skip_instance_cache": True}
    )
    store.save({"w": torch.arange(3.0)}, epoch=1)
    assert torch.equal(store.load()["w"], torch.arange(3.0))
