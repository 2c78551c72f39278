"""Fixtures shared by the storage tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import StoreTarget


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreTarget]:
    """A store several processes can share: a local directory, or a bucket on the S3 server."""
    if request.param == "local":
        yield StoreTarget("local", str(tmp_path / "store"), None)
    else:
        bucket, options = request.getfixturevalue("s3_bucket")
        yield StoreTarget("s3", f"s3://{bucket}/run1", options)
