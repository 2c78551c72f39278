"""A store's two tiers: a fast local store and its mirror, the durable tier (issue 56).

``CheckpointStore.fetch_newest`` brings the durable tier's newest version into an empty or older
fast tier: only the files it lacks, each verified against the manifest's checksum (a name and a
size say nothing of the bytes), then the manifest. A drain killed at any instant (SIGKILL) leaves
the durable tier with committed versions that all load, and loses only what was not yet there.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptflow.storage import CheckpointError, CheckpointStore
from tests.conftest import StoreTarget, assert_same_state
from tests.storage.test_dedup import dense, fine_tune, verify_all


def durable_of(target: StoreTarget) -> tuple[str, dict]:
    """The durable tier's URL and options: a local directory or a bucket on SeaweedFS."""
    return target.url, {**(target.storage_options or {}), "skip_instance_cache": True}


def local(path: Path) -> StoreTarget:
    return StoreTarget("local", str(path), None)


def tiered(tmp_path: Path, target: StoreTarget, steps: int) -> tuple[CheckpointStore, str, dict]:
    """A fast tier of ``steps`` fine-tune saves, each mirrored to the durable tier."""
    url, options = durable_of(target)
    fast = CheckpointStore(tmp_path / "fast")
    for step in range(steps):
        fast.save(fine_tune(step))
        fast.mirror_version(step, url, storage_options=options)
    return fast, url, options


def shard_bytes(store: CheckpointStore, version: int) -> dict[str, int]:
    return {s.file: s.size for s in store.manifest(version).shards}


def test_an_empty_fast_tier_gets_the_newest_version_with_only_the_bytes_it_needs(
    tmp_path: Path, target: StoreTarget
) -> None:
    _, url, options = tiered(tmp_path, target, 4)
    shutil.rmtree(tmp_path / "fast")  # the machine is gone
    new = CheckpointStore(tmp_path / "fast")
    got = new.fetch_newest(url, storage_options=options)
    assert got is not None and got.version == 3 and got.kept == 0 and not got.archived
    needed = shard_bytes(CheckpointStore(url, storage_options=options), 3)
    assert got.files == len(needed) and got.bytes == sum(needed.values())  # the base once, the head
    assert [v.version for v in new.versions()] == [3]
    assert_same_state(new.load(), fine_tune(3))
    assert verify_all(new) == {3: None}
    assert new.fetch_newest(url, storage_options=options) is None  # as new as the durable tier
    # it is the same store: it saves on and mirrors to the same URL, which loads the new version
    new.save(fine_tune(4))
    new.mirror_version(4, url, storage_options=options)
    assert_same_state(CheckpointStore(url, storage_options=options).load(4), fine_tune(4))


def test_an_older_fast_tier_keeps_the_files_it_holds_after_hashing_them(
    tmp_path: Path, target: StoreTarget
) -> None:
    fast, url, options = tiered(tmp_path, target, 2)
    keep = CheckpointStore(tmp_path / "keep")
    shutil.copytree(tmp_path / "fast", tmp_path / "keep", dirs_exist_ok=True)  # at version 1
    for step in (2, 3):
        fast.save(fine_tune(step))
        fast.mirror_version(step, url, storage_options=options)
    got = keep.fetch_newest(url, storage_options=options)
    assert got is not None and got.version == 3
    assert got.kept == 1 and got.files == 1  # the frozen base was there: only the head came
    assert_same_state(keep.load(), fine_tune(3))


def test_a_file_of_the_right_name_and_size_but_other_bytes_is_fetched_again(
    tmp_path: Path, target: StoreTarget
) -> None:
    _, url, options = tiered(tmp_path, target, 2)
    shutil.copytree(tmp_path / "fast", tmp_path / "old")
    old = CheckpointStore(tmp_path / "old")
    base = next((tmp_path / "old" / "v000000").glob("*.h5"))
    data = bytearray(base.read_bytes())
    data[-100] ^= 0xFF  # rotted on the old disk: same name, same size
    base.write_bytes(bytes(data))
    for version in (1, 0):
        old.delete(version)
    got = old.fetch_newest(url, storage_options=options)
    assert got is not None and got.version == 1 and got.kept == 0
    assert_same_state(old.load(), fine_tune(1))


def test_a_damaged_durable_copy_is_refused_and_nothing_commits(tmp_path: Path) -> None:
    _, url, options = tiered(tmp_path, local(tmp_path / "durable"), 2)
    head = sorted((Path(url) / "v000001").glob("*.h5"))[-1]
    data = bytearray(head.read_bytes())
    data[-10] ^= 0xFF
    head.write_bytes(bytes(data))
    new = CheckpointStore(tmp_path / "new")
    with pytest.raises(CheckpointError, match="does not hold the bytes its manifest names") as caught:
        new.fetch_newest(url, storage_options=options)
    assert head.name in str(caught.value)
    assert new.latest() is None


def test_a_fast_tier_holding_another_store_is_refused_before_a_byte_is_written(tmp_path: Path) -> None:
    _, url, options = tiered(tmp_path, local(tmp_path / "durable"), 2)
    other = CheckpointStore(tmp_path / "other")
    other.save(dense(0))
    other.mirror_version(0, str(tmp_path / "its-mirror"), storage_options={})  # it has an identity
    before = sorted(p.name for p in (tmp_path / "other").rglob("*"))
    with pytest.raises(CheckpointError, match="holds versions of another store"):
        other.fetch_newest(url, storage_options=options)
    assert sorted(p.name for p in (tmp_path / "other").rglob("*")) == before


def test_a_version_the_durable_tier_holds_in_a_tarball_comes_back_as_the_tarball(tmp_path: Path) -> None:
    url = str(tmp_path / "durable")
    fast = CheckpointStore(tmp_path / "fast")
    for step in range(3):
        fast.save(dense(step))
    index = fast.archive([0, 1, 2])
    fast.mirror_archive(index.tar, url, storage_options={})
    shutil.rmtree(tmp_path / "fast")
    new = CheckpointStore(tmp_path / "fast")
    got = new.fetch_newest(url, storage_options={})
    assert got is not None and got.version == 2 and got.archived
    assert_same_state(new.load(), dense(2))
    assert [(v.version, v.archived) for v in new.versions()] == [(0, True), (1, True), (2, True)]


DRAIN = """
import sys
from ckptflow.storage import CheckpointStore
fast, url = CheckpointStore(sys.argv[1]), sys.argv[2]
for info in fast.versions():
    fast.mirror_version(info.version, url, storage_options={})
    print(info.version, flush=True)
"""


@pytest.mark.crash
def test_a_drain_killed_at_random_instants_leaves_only_versions_that_load(tmp_path: Path) -> None:
    """SIGKILL at random instants while versions go up: every version committed on the durable tier
    verifies and loads; the fast tier's others are what it lacks; the next drain completes it."""
    fast = CheckpointStore(tmp_path / "fast")
    url = str(tmp_path / "durable")
    states: dict[int, dict] = {}
    rng = random.Random(56)
    kills, took = 0, 1.0  # took: how long the last drain that ended on its own ran
    for _ in range(10):
        for _ in range(2):  # new versions each round: the drain always has work
            state = {"w": torch.randn(2048, 1024), "b": torch.full((64,), float(len(states)))}
            states[fast.save(state).version] = state
        began = time.monotonic()
        drain = subprocess.Popen(
            [sys.executable, "-c", DRAIN, str(tmp_path / "fast"), url], env=dict(os.environ)
        )
        time.sleep(rng.uniform(0.1, 0.9) * took)  # an instant inside a drain as long as the last
        if drain.poll() is None:
            os.kill(drain.pid, signal.SIGKILL)
            kills += 1
        else:
            took = time.monotonic() - began
        drain.wait()
        durable = CheckpointStore(url)
        held = [v.version for v in durable.versions()]
        assert verify_all(durable) == dict.fromkeys(held)
        for version in held:
            assert_same_state(durable.load(version), states[version])
    assert kills >= 3, "the drains ended before any kill: make the versions bigger"
    subprocess.run(
        [sys.executable, "-c", DRAIN, str(tmp_path / "fast"), url], env=dict(os.environ), check=True
    )
    assert [v.version for v in CheckpointStore(url).versions()] == sorted(states)


def test_ls_durable_shows_which_tiers_hold_each_version_and_what_is_not_durable_yet(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from ckptflow.flows.cli import app

    fast, url, _ = tiered(tmp_path, local(tmp_path / "durable"), 3)
    fast.delete(0)  # retention on the fast tier: only the durable tier keeps it
    fast.save(fine_tune(3))  # committed, not mirrored yet
    result = CliRunner().invoke(app, ["ls", str(tmp_path / "fast"), "--durable", url, "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    tiers = {v["version"]: v["tiers"] for v in document["versions"]}
    assert tiers == {0: ["durable"], 1: ["fast", "durable"], 2: ["fast", "durable"], 3: ["fast"]}
    assert document["not_durable"] == [3]
    text = CliRunner().invoke(app, ["ls", str(tmp_path / "fast"), "--durable", url])
    assert f"durable tier {url}: version 3 not durable yet" in text.output


def test_the_documented_library_calls_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.pipeline.helpers import documented_block

    block = documented_block("<!-- tests/storage/test_tiers.py runs the next code block as written -->")
    monkeypatch.chdir(tmp_path)
    exec(compile(block[len("```python\n") :].split("\n```", 1)[0], "docs/storage.md", "exec"), {})
    assert CheckpointStore(tmp_path / "fast").latest() is not None
