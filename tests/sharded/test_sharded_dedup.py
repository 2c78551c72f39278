"""Content-addressed sharded saves: an FSDP2 fine-tune whose base is frozen writes the base's chunks
once, whichever way it saves (``store.save``, ``save_async``, a ``dcp.save`` of its own), and every
version loads bitwise at any world size after the versions it references are pruned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptflow.storage import CheckpointStore
from tests.sharded.conftest import FsdpJob


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Any]:
    """The store's URL and storage options: a local directory, or a SeaweedFS bucket."""
    if request.param == "local":
        return str(tmp_path / "store"), None
    bucket, options = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/frozen", options


def test_a_frozen_base_under_fsdp_is_written_once_and_loads_bitwise_at_any_world(
    where: tuple[str, Any], tmp_path: Path
) -> None:
    url, options = where
    job = FsdpJob.run("frozen_saves", 2, url, tmp_path / "job", storage_options=options)
    saves = job.result()["saves"]
    (first, first_new, first_size), *later = saves
    assert first_new == first_size  # nothing to share yet
    assert later[0][1] == 0, saves  # the same state again: every chunk referenced, no file written
    for _, new, size in later[1:3]:  # the head and its Adam state changed: about 30% of the bytes
        assert 0 < new < 0.4 * size, saves
    assert later[3][1] == 0, saves  # a dcp.save of the same state again

    store = CheckpointStore(url, storage_options=options)
    last = saves[-1][0]
    manifest = store.manifest(last)
    # Its base from the first version, its head from the save before it (the same state).
    assert {s.version for s in manifest.shards if s.version is not None} == {first, saves[-2][0]}
    shared = [b for b in manifest.blobs if manifest.shards[b.shard].version is not None]
    assert shared and all(b.pieces for b in shared)  # a resharded read checks pieces, not whole blobs
    for version, *_ in saves:
        store.verify(version)
    # Each save's parent is the one before, a dcp.save through store.dcp_writer too.
    assert [store.manifest(v).lineage.parent for v, *_ in saves[1:]] == [v for v, *_ in saves[:-1]]

    gone = store.prune(keep_last=1)  # the versions before go; the files the last one reads stay
    assert gone == [v for v, *_ in saves[:-1]] and [v.version for v in store.versions()] == [last]
    store.gc()
    store.verify(last)
    for world in (3, 2):
        loaded = FsdpJob.run(
            "load", world, url, tmp_path / f"load{world}", "--frozen", storage_options=options
        )
        assert loaded.full() == job.full(), f"W={world}"
