"""A real S3 server that checks credentials: SeaweedFS configured with one access key.

The session's server (tests/conftest.py) accepts any keys; this one, started for this module,
refuses every key but its own, as S3 does, so the error a user sees for wrong credentials is
the one tested here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import torch

from ckptflow.storage import CheckpointStore, StorageUnavailableError
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
