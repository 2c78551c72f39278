"""A sharded version is as safe as any other: no pickle, each byte once, commit or nothing,
every crafted chunk refused, every byte verified."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptflow.storage import CheckpointStore, CorruptShardError, ManifestError
from ckptflow.storage.format.manifest import SEAL_KEY, seal
from tests.disks import files_under, fill, free_bytes, small_tmpfs
from tests.sharded.conftest import FsdpJob, Saved, digest

pytestmark = pytest.mark.timeout(300)


def copy_store(saved: Saved, tmp_path: Path) -> Path:
    target = tmp_path / "store"
    shutil.copytree(saved.url, target)
    return target


class TestNothingPickled:
    @pytest.mark.parametrize("which", ["saved_by_store", "saved_by_dcp"])
    def test_every_file_is_hdf5_or_json(self, which: str, request: pytest.FixtureRequest) -> None:
        saved: Saved = request.getfixturevalue(which)
        files = [p for p in Path(saved.url).rglob("*") if p.is_file()]
        assert any(p.suffix == ".h5" for p in files)
        for path in files:
            head = path.read_bytes()[:8]
            assert not head.startswith(b"\x80"), f"{path} is a pickle"
            assert not head.startswith(b"PK"), f"{path} is a zip (a torch.save archive)"
            if path.suffix == ".h5":
                assert head == b"\x89HDF\r\n\x1a\n", path
            elif path.name == "latest":
                assert re.fullmatch(r"v\d{6}\n", path.read_text()), path
            else:
                json.loads(path.read_text())  # the manifest


def test_each_rank_writes_its_share_and_each_byte_once(saved_by_store: Saved) -> None:
    manifest = CheckpointStore(saved_by_store.url).manifest()
    state_bytes = sum(entry.nbytes for entry in manifest.chunked)
    by_rank = {0: 0, 1: 0}
    for blob in manifest.blobs:
        by_rank[manifest.shards[blob.shard].rank] += blob.nbytes
    assert sum(by_rank.values()) == state_bytes, "replicated chunks (Adam's step) are written once"
    assert max(by_rank.values()) <= 0.75 * state_bytes, by_rank
    assert manifest.world_size == 2


def test_a_rank_killed_mid_save_leaves_the_previous_version_latest(
    saved_by_store: Saved, tmp_path: Path
) -> None:
    store = copy_store(saved_by_store, tmp_path)
    job = FsdpJob.start("kill_in_save", 2, str(store), tmp_path / "job")
    try:
        job.wait_for("blocked")
        job.kill(1)
        job.wait(timeout=120)  # rank 0 hears of it through gloo and fails
    finally:
        job.reap()
    assert job.procs[0].returncode != 0
    reopened = CheckpointStore(store)
    assert [v.version for v in reopened.versions()] == [saved_by_store.version]
    assert digest(reopened.load()) == saved_by_store.full


def test_a_rank_killed_mid_save_is_a_rank_failure_on_the_others(
    saved_by_store: Saved, tmp_path: Path
) -> None:
    """Bug: rank 1 SIGKILLed in a sharded sync save made rank 0 raise gloo's raw ``RuntimeError:
    [...pair.cc] Read error ... Connection reset by peer`` instead of RankFailedError (as the async
    path and replicated saves do), saying neither what failed nor that nothing was committed."""
    store = copy_store(saved_by_store, tmp_path)
    job = FsdpJob.start("kill_in_save", 2, str(store), tmp_path / "job")
    try:
        job.wait_for("blocked")
        job.kill(1)
        job.wait(timeout=120)
    finally:
        job.reap()
    kind, message, cause = job.result(0)["save"]
    assert (kind, cause) == ("RankFailedError", "RuntimeError"), job.logs()
    assert "a rank of the checkpoint group died or timed out" in message, message
    assert f"the save of version {saved_by_store.version + 1}" in message, message
    assert "nothing was committed" in message, message
    assert [v.version for v in CheckpointStore(store).versions()] == [saved_by_store.version]


@pytest.fixture(params=[96 << 10, 0], ids=["part-written", "nothing-free"])
def full_disk(saved_by_store: Saved, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """``saved_by_store`` copied onto a real 2 MiB tmpfs, filled up but for 96 KiB (less than the
    ranks' chunks of one more version, about 200 KiB, more than a claim and a shard's start), or
    for nothing (the claim itself fails)."""
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        shutil.copytree(saved_by_store.url, disk / "store")
        fill(disk, leave=request.param)
        yield disk


def test_a_save_that_fills_the_disk_removes_its_partial_files(
    saved_by_store: Saved, full_disk: Path, tmp_path: Path
) -> None:
    """Bug: a sharded save (sync or async) that failed on a full disk left its shards and its
    ``.claim.json`` (the disk stayed full) while the error said a failed save removes its partial
    files. Rank 0 now removes them once DCP has gathered every rank's outcome (every rank stopped
    writing), so the disk has its free space back and the committed version is intact. With
    nothing free, the claim itself fails and leaves neither its temporary file nor its directory."""
    store = full_disk / "store"
    before, free = files_under(store), free_bytes(full_disk)
    job = FsdpJob.run("full_disk", 2, str(store), tmp_path / "job")
    results = [job.result(0), job.result(1)]
    for name in ("save", "save_async"):
        kinds = sorted(r[name][0] for r in results)
        assert kinds[0] in ("RankFailedError", "SaveFailedError", "StorageUnavailableError"), results
        assert any("no space left on the device" in r[name][1] for r in results), results
        left, free_after = results[0]["left"][name]
        assert left == before, f"{name} left {sorted(set(left) - set(before))}"
        assert free_after == free, (name, free_after, free)
    assert files_under(store) == before and free_bytes(full_disk) == free
    reopened = CheckpointStore(store)
    assert [v.version for v in reopened.versions()] == [saved_by_store.version]
    assert digest(reopened.load()) == saved_by_store.full


def test_a_save_that_fails_on_one_rank_names_that_rank_everywhere(
    saved_by_store: Saved, tmp_path: Path
) -> None:
    """Rank 1's disk is full: it raises that error, rank 0 says rank 1 failed and why (not DCP's
    CheckpointException), for a save and an async save, and nothing is committed."""
    store = copy_store(saved_by_store, tmp_path)
    job = FsdpJob.run("fail_in_save", 2, str(store), tmp_path / "job")
    first, second = job.result(0), job.result(1)
    assert second["save"][0] == "StorageUnavailableError" and first["save"][0] == "RankFailedError"
    assert second["save_async"][0] == first["save_async"][0] == "SaveFailedError"  # as any async save
    for name in ("save", "save_async"):
        assert "no space left on device (rank 1's disk)" in second[name][1]
        assert "failed on rank 1: StorageUnavailableError: no space left on device" in first[name][1]
    assert [v.version for v in CheckpointStore(store).versions()] == [saved_by_store.version]


Edit = Callable[[dict[str, Any]], None]


def _chunks(m: dict[str, Any]) -> list[dict[str, Any]]:
    return next(e for e in m["chunked"] if len(e["chunks"]) == 2)["chunks"]


def _overlap(m: dict[str, Any]) -> None:
    first, second = _chunks(m)
    second["offsets"] = list(first["offsets"])


def _outside(m: dict[str, Any]) -> None:
    _chunks(m)[1]["offsets"][0] += 1


def _gap(m: dict[str, Any]) -> None:
    entry = next(e for e in m["chunked"] if len(e["chunks"]) == 2)
    entry["chunks"] = entry["chunks"][:1]


def _wrong_blob(m: dict[str, Any]) -> None:
    _chunks(m)[0]["blob"] = len(m["blobs"])


def _small_blob(m: dict[str, Any]) -> None:
    chunk = _chunks(m)[0]
    other = next(i for i, b in enumerate(m["blobs"]) if b["nbytes"] != m["blobs"][chunk["blob"]]["nbytes"])
    chunk["blob"] = other


def _pieces_miscounted(m: dict[str, Any]) -> None:
    blob = m["blobs"][_chunks(m)[0]["blob"]]
    blob["pieces"] = blob["pieces"] + blob["pieces"][:1]


def _piece_checksum(text: str) -> Edit:
    """The last piece checksum of the first chunk's blob replaced by ``text``."""

    def edit(m: dict[str, Any]) -> None:
        m["blobs"][_chunks(m)[0]["blob"]]["pieces"][-1] = text

    return edit


def _pieces_without_size(m: dict[str, Any]) -> None:
    del m["blobs"][_chunks(m)[0]["blob"]]["piece_bytes"]


def _dangling(m: dict[str, Any]) -> None:
    m["structure"]["model"]["embed.weight"] = {"$chunked": len(m["chunked"])}


CRAFTED: dict[str, tuple[Edit, str]] = {
    "overlapping chunks": (_overlap, "once exactly"),
    "a chunk outside the shape": (_outside, "leave shape"),
    "a part not covered": (_gap, "once exactly"),
    "a chunk's blob not listed": (_wrong_blob, "is not listed"),
    "a chunk's blob of another size": (_small_blob, "holds"),
    "a $chunked reference to nothing": (_dangling, "is not one of the"),
    "a chunk's piece checksums miscounted": (_pieces_miscounted, "checksums for"),
    "piece checksums without their size": (_pieces_without_size, "come together"),
    "a piece checksum not hex": (_piece_checksum("zz" * 8), "is not an xxh3-64 checksum"),
    "a piece checksum with a newline": (_piece_checksum("0" * 16 + "\n"), "is not an xxh3-64 checksum"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_chunk_is_refused_and_named(saved_by_store: Saved, tmp_path: Path, case: str) -> None:
    store = copy_store(saved_by_store, tmp_path)
    path = store / f"v{saved_by_store.version:06d}" / "manifest.json"
    manifest = json.loads(path.read_text())
    edit, words = CRAFTED[case]
    edit(manifest)
    path.write_text(json.dumps(seal(manifest, SEAL_KEY)))  # sealed again, as a deliberate crafter would
    with pytest.raises(ManifestError) as caught:
        CheckpointStore(store).load(saved_by_store.version)
    assert words in str(caught.value) and "manifest.json" in str(caught.value)


def damage_largest_chunk(saved: Saved, tmp_path: Path) -> Path:
    """A copy of the store with one byte flipped in the middle of its largest chunk."""
    store = copy_store(saved, tmp_path)
    manifest = CheckpointStore(store).manifest(saved.version)
    blob = max(manifest.blobs, key=lambda b: b.nbytes)
    shard = store / f"v{saved.version:06d}" / manifest.shards[blob.shard].file
    data = bytearray(shard.read_bytes())
    assert blob.offset is not None
    data[blob.offset + blob.nbytes // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return store


def test_verify_checks_every_chunk(saved_by_store: Saved, tmp_path: Path) -> None:
    CheckpointStore(saved_by_store.url).verify(saved_by_store.version)
    store = damage_largest_chunk(saved_by_store, tmp_path)
    reopened = CheckpointStore(store)
    with pytest.raises(CorruptShardError):
        reopened.verify(saved_by_store.version)
    with pytest.raises(CorruptShardError):
        reopened.load(saved_by_store.version)


def test_a_load_that_fails_on_one_rank_fails_on_every_rank_with_that_ranks_error(
    saved_by_store: Saved, tmp_path: Path
) -> None:
    """Each rank plans and reads its own part (no plans exchanged); one collective then tells
    every rank whether all succeeded. The rank whose chunk is damaged raises the corruption, the
    other one an error naming that rank and what it found, and nobody raises DCP's wrapper."""
    store = damage_largest_chunk(saved_by_store, tmp_path)
    version = str(saved_by_store.version)
    job = FsdpJob.run("load_errors", 2, str(store), tmp_path / "job", "--version", version)
    results = [job.result(rank) for rank in (0, 1)]
    assert [r["missing"][0] for r in results] == ["VersionNotFoundError"] * 2
    assert all("version 99 is not committed" in r["missing"][1] for r in results)
    kinds = sorted(r["damaged"][0] for r in results)
    assert kinds == ["CorruptShardError", "RankLoadError"], results
    damaged = next(rank for rank, r in enumerate(results) if r["damaged"][0] == "CorruptShardError")
    told = results[1 - damaged]["damaged"][1]
    assert f"failed on rank {damaged}: CorruptShardError: corrupt checkpoint file" in told
    # Stateful objects whose load_state_dict runs a barrier: none is called, and nobody hangs.
    assert [r["stateful"][0] for r in results] == [r["damaged"][0] for r in results]
    assert [r["stateful"][2] for r in results] == [[], []]
    # A state that does not fit the version: each rank names the key, nothing is read into it.
    for r in results:
        assert r["extra"][0] == r["shape"][0] == "StateMismatchError", r
        assert "has no 'model.extra.weight', which the state holds" in r["extra"][1]
        assert "'model.head.weight' is [64, 32] in it and [3] in the state" in r["shape"][1]
        assert "build the model and optimizer as they were" in r["shape"][1] and r["untouched"]
