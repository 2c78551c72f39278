"""A silent S3 peer (it accepts connections and never answers) fails a library call in bounded time.

Before, ``CheckpointStore('s3://...').versions()`` against such an endpoint had not returned
after 400 s: botocore's and s3fs's retries multiplied (5 x 5 attempts of a 15 s read).
"""

from __future__ import annotations

import time

import pytest

from ckptflow.storage import CheckpointStore, StorageUnavailableError
from ckptflow.storage.files.location import open_location
from ckptflow.storage.files.s3options import S3_ATTEMPTS, S3FS_RETRIES


def _options(endpoint: str, **config: object) -> dict[str, object]:
    return {
        "key": "k",
        "secret": "s",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": config,
    }


def test_a_silent_endpoint_fails_listing_in_bounded_time(silent_endpoint: str) -> None:
    store = CheckpointStore("s3://bucket/run", storage_options=_options(silent_endpoint, read_timeout=1))
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError) as caught:
        store.versions()
    took = time.monotonic() - started
    # at most S3FS_RETRIES x S3_ATTEMPTS reads of 1 s each, plus backoff between them
    assert took < 4 * S3FS_RETRIES * S3_ATTEMPTS, f"took {took:.1f}s"
    assert silent_endpoint.removeprefix("http://") in str(caught.value)
    assert "Traceback" not in str(caught.value)


def test_s3_locations_get_timeouts_and_bounded_retries_by_default() -> None:
    loc = open_location("s3://bucket/run", {"key": "k", "secret": "s"})
    config = loc.fs.config_kwargs
    assert config["connect_timeout"] > 0 and config["read_timeout"] > 0
    assert config["retries"]["total_max_attempts"] == S3_ATTEMPTS
    assert loc.fs.retries == S3FS_RETRIES
    given = open_location("s3://bucket/run", {"key": "k", "config_kwargs": {"read_timeout": 7}})
    assert given.fs.config_kwargs["read_timeout"] == 7  # what the options set wins
