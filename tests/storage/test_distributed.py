"""Saving from a real torch.distributed job: gloo on CPU, 2 and 3 processes on 127.0.0.1.

Each rank is a real process (``dist_child.py``) that joins a gloo job and runs
a scenario against a distributed :class:`CheckpointStore`; the test then looks
at what the ranks report and at the store itself, from this process, as a
plain (non-distributed) store. What must hold:

- round trip: the replicated state loads bitwise equal with 2, 3 and 1
  process(es); per-rank state goes back to the same rank at the same world
  size, and rank 0's comes back (with a RankStateWarning) at another one;
- the writing is spread: each of W ranks writes about 1/W of the bytes;
- a rank SIGKILLed mid-save, a rank whose write fails, ranks whose states
  differ: nothing is committed, every surviving rank raises (none hangs), the
  previous version stays the latest, and a retry commits;
- a save on a full disk (a real tmpfs) frees it: rank 0 removes every rank's
  partial files once all reported;
- an async save runs beside the training loop's own collectives;
- a single-process save stays format 1 unless it carries per-rank state.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptflow.storage import CheckpointStore, RankStateWarning, StoreOptions
from ckptflow.storage.format.manifest import SHARED_FORMAT_VERSION
from ckptflow.storage.versions.commit import list_dirs
from tests.children import CHILDREN
from tests.children.dist_child import digest, make_rank_state, make_state
from tests.conftest import assert_same_state, plain_name, tensor_bits
from tests.disks import files_under, fill, free_bytes, small_tmpfs
from tests.jobs import RankJob

pytestmark = pytest.mark.timeout(120)

CHILD = CHILDREN / "dist_child.py"
SEED = 11


# -- running a job -------------------------------------------------------------------------------


class Job(RankJob):
    """``world`` processes of dist_child.py running one scenario; each writes result-r{rank}.json."""

    @classmethod
    def start(
        cls,
        scenario: str,
        world: int,
        url: str,
        out: Path,
        *args: str,
        storage_options: dict[str, Any] | None = None,
    ) -> Job:
        cmd = [sys.executable, str(CHILD), scenario, url, str(out), "--seed", str(SEED), *args]
        env = {"CKPTFLOW_STORAGE_OPTIONS": json.dumps(storage_options)}
        return cls(cls.launch(cmd, world, out, env), out)

    @classmethod
    def run(cls, scenario: str, world: int, url: str, out: Path, *args: str, **kwargs: Any) -> list[dict]:
        """Start the job, wait for every rank to finish, return each rank's results."""
        job = cls.start(scenario, world, url, out, *args, **kwargs)
        try:
            job.wait()
            return job.results(require_done=True)
        finally:
            job.reap()

    def results(self, *, require_done: bool = False) -> list[dict]:
        found = []
        for rank in range(len(self.procs)):
            path = self.out / f"result-r{rank}.json"
            result = json.loads(path.read_text()) if path.exists() else {}
            if require_done and not result.get("done"):
                pytest.fail(f"rank {rank} did not finish its scenario{self.logs()}")
            found.append(result)
        return found


def ok(result: dict, step: str) -> Any:
    """The value of a step that must have succeeded."""
    got = result.get(step)
    assert got is not None, f"step {step!r} did not run: {sorted(result)}"
    assert "ok" in got, f"step {step!r} failed: {got['error']}: {got['message']}\n{got['traceback']}"
    return got["ok"]


def failed(result: dict, step: str) -> dict:
    """The error of a step that must have failed."""
    got = result.get(step)
    assert got is not None, f"step {step!r} did not run: {sorted(result)}"
    assert "error" in got, f"step {step!r} succeeded, it must fail: {got['ok']}"
    return got


def as_json(value: Any) -> Any:
    return json.loads(json.dumps(value))


def want_digest(state: Any) -> Any:
    return as_json(digest(state))


def assert_tensors_equal(got: Any, want: Any) -> None:
    """Every tensor of ``want`` has an equal one in ``got``: same dtype, shape, and raw bytes."""
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        assert tensor_bits(got) == tensor_bits(want)
    elif isinstance(want, dict):
        for key in want:
            assert_tensors_equal(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        for g, w in zip(got, want, strict=True):
            assert_tensors_equal(g, w)


def replicated_bytes_by_rank(store: CheckpointStore, version: int) -> dict[int, int]:
    """Bytes of replicated-state shards in ``version``, by the rank that wrote them."""
    by_rank: dict[int, int] = defaultdict(int)
    for shard in store.manifest(version).shards:
        if shard.file.startswith("shard-"):
            by_rank[shard.rank] += shard.size
    return dict(by_rank)


def assert_loaded_like(result: dict, step: str, want: Any) -> None:
    got = ok(result, step)
    assert got["digest"] == want_digest(want)
    assert got["sharing"] == {"tied": True, "views": True}


# -- one job that saves with two ranks, one that loads with three ---------------------------------


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """W=2 saves v0 (sync) and v1 (async beside all_reduce), then loads both."""
    base = tmp_path_factory.mktemp("dist2")
    url = str(base / "store")
    return url, Job.run("roundtrip", 2, url, base / "job")


@pytest.fixture(scope="module")
def three_rank_job(
    two_rank_job: tuple[str, list[dict]], tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    """W=3 loads the W=2 checkpoint, then saves v2 and loads its own rank state."""
    url, _ = two_rank_job
    return Job.run("load", 3, url, tmp_path_factory.mktemp("dist3"), "--version", "2")


class TestRoundTrip:
    def test_two_ranks_load_the_replicated_state_they_saved(self, two_rank_job):
        _, results = two_rank_job
        for result in results:
            assert ok(result, "save0")["version"] == 0
            assert_loaded_like(result, "load0", make_state(SEED, 0))

    def test_a_frozen_part_is_written_once(self, two_rank_job):
        """Each rank references the bytes of its share that version 0 holds (the frozen part)."""
        url, _ = two_rank_job
        raw = json.loads((Path(url) / "v000001" / "manifest.json").read_bytes())
        shared = [s for s in raw["shards"] if s.get("version") == 0]
        assert shared and all(s["file"].startswith("shard-r") for s in shared)
        frozen = [t for t in raw["tensors"] if t["path"].startswith("model/frozen.")]
        assert {raw["shards"][raw["blobs"][t["blob"]]["shard"]].get("version") for t in frozen} == {0}
        assert {s["rank"] for s in shared} == {0, 1}  # both ranks referenced their share

    def test_same_world_size_gives_each_rank_its_own_state(self, two_rank_job):
        _, results = two_rank_job
        for rank, result in enumerate(results):
            for v in (0, 1):
                got = ok(result, f"rank_state{v}")
                assert got["digest"] == want_digest(make_rank_state(SEED, v, rank))
                assert got["warnings"] == []
        assert results[0]["rank_state0"]["ok"]["digest"] != results[1]["rank_state0"]["ok"]["digest"]

    def test_three_ranks_load_a_two_rank_checkpoint(self, three_rank_job):
        for result in three_rank_job:
            assert_loaded_like(result, "load0", make_state(SEED, 0))

    def test_three_ranks_get_rank_zeros_state_with_a_warning(self, three_rank_job):
        for rank, result in enumerate(three_rank_job):
            got = ok(result, "rank_state0")
            assert got["digest"] == want_digest(make_rank_state(SEED, 0, 0))
            assert len(got["warnings"]) == 1, got["warnings"]
            assert got["warnings"][0].startswith("RankStateWarning: version 0 was saved by 2 rank(s)")
            assert f"rank {rank} gets the per-rank state of rank 0" in got["warnings"][0]

    def test_three_ranks_save_and_each_gets_its_own_state_back(self, three_rank_job):
        for rank, result in enumerate(three_rank_job):
            assert ok(result, "save")["version"] == 2
            got = ok(result, "rank_state")
            assert got["digest"] == want_digest(make_rank_state(SEED, 2, rank))
            assert got["warnings"] == []

    def test_one_process_loads_a_two_rank_checkpoint_bitwise(self, two_rank_job):
        url, _ = two_rank_job
        store = CheckpointStore(url)
        want = make_state(SEED, 0)
        got = store.load(0)
        assert_same_state(got, want)
        assert_tensors_equal(got, want)
        assert got["model"]["layers.0.weight"].dtype == torch.bfloat16
        assert got["model"]["head.weight"] is got["model"]["embed.weight"]
        assert store.verify(0).version == 0

    def test_one_process_gets_rank_zeros_state_with_a_warning(self, two_rank_job):
        url, _ = two_rank_job
        store = CheckpointStore(url)
        with pytest.warns(RankStateWarning, match="saved by 2 rank"):
            got = store.load_rank_state(0)
        assert_same_state(got, make_rank_state(SEED, 0, 0))
        assert_tensors_equal(got, make_rank_state(SEED, 0, 0))

    def test_one_process_reads_any_rank_by_naming_the_world_size(self, two_rank_job, recwarn):
        url, _ = two_rank_job
        store = CheckpointStore(url)
        for rank in (0, 1):
            assert_same_state(
                store.load_rank_state(0, rank=rank, world_size=2), make_rank_state(SEED, 0, rank)
            )
        assert not [w for w in recwarn if issubclass(w.category, RankStateWarning)]

    def test_manifest_records_the_world_size_and_the_ranks(self, two_rank_job):
        url, _ = two_rank_job
        raw = json.loads((Path(url) / "v000000" / "manifest.json").read_bytes())
        assert raw["format_version"] == SHARED_FORMAT_VERSION  # content keys: the newest format
        assert raw["world_size"] == 2
        assert len(raw["ranks"]) == 2


class TestWritingIsSpread:
    def test_each_of_two_ranks_writes_about_half(self, two_rank_job):
        url, _ = two_rank_job
        store = CheckpointStore(url)
        for v in (0, 1):
            by_rank = replicated_bytes_by_rank(store, v)
            total = sum(by_rank.values())
            assert sorted(by_rank) == [0, 1]
            for rank, size in by_rank.items():
                assert 0.45 <= size / total <= 0.55, (v, rank, by_rank)
        files = sorted(plain_name(p.name) for p in (Path(url) / "v000000").iterdir())
        assert "state-r0.h5" in files and "state-r1.h5" in files
        assert any(f.startswith("shard-r0-") for f in files) and any(f.startswith("shard-r1-") for f in files)

    def test_blob_bytes_split_evenly_over_two_ranks(self, two_rank_job):
        url, _ = two_rank_job
        manifest = CheckpointStore(url).manifest(0)
        by_rank: dict[int, int] = defaultdict(int)
        for blob in manifest.blobs:
            by_rank[manifest.shards[blob.shard].rank] += blob.nbytes
        largest = max(b.nbytes for b in manifest.blobs)
        assert abs(by_rank[0] - by_rank[1]) <= largest, dict(by_rank)

    def test_each_of_three_ranks_writes_about_a_third(self, two_rank_job, three_rank_job):
        url, _ = two_rank_job
        by_rank = replicated_bytes_by_rank(CheckpointStore(url), 2)
        total = sum(by_rank.values())
        assert sorted(by_rank) == [0, 1, 2]
        for rank, size in by_rank.items():
            assert 0.27 <= size / total <= 0.40, (rank, by_rank)


class TestShardsOption:
    """Bug fixed: ``shards`` meant files per rank, so ``--shards 4`` gave 4 files at W=1, 6 at W=2
    and 9 at W=3. It is the number of shard files of a version at every world size."""

    @pytest.mark.parametrize("world", [1, 2, 3])
    def test_a_version_has_as_many_shard_files_as_asked_at_every_world_size(self, tmp_path, world):
        url = str(tmp_path / "store")
        Job.run("save", world, url, tmp_path / "job", "--version", "0", "--shards", "4")
        manifest = CheckpointStore(url).manifest(0)
        files = sorted(p.name for p in (Path(url) / "v000000").glob("shard-*.h5"))
        assert len(files) == 4, files
        assert sorted(s.file for s in manifest.shards if s.file.startswith("shard-")) == files
        assert {s.rank for s in manifest.shards if s.file.startswith("shard-")} == set(range(world))

    def test_more_ranks_than_shards_write_one_file_each(self, tmp_path):
        url = str(tmp_path / "store")
        Job.run("save", 3, url, tmp_path / "job", "--version", "0", "--shards", "2")
        files = sorted(plain_name(p.name) for p in (Path(url) / "v000000").glob("shard-*.h5"))
        assert files == ["shard-r0-00.h5", "shard-r1-00.h5", "shard-r2-00.h5"]


class TestAsyncSave:
    def test_async_save_commits_beside_the_training_loops_collectives(self, two_rank_job):
        url, results = two_rank_job
        for result in results:
            got = ok(result, "save1_async")
            assert got["info"]["version"] == 1
            assert got["in_flight"] >= 1, got  # the loop's all_reduce ran while the save was writing
            assert got["wrong"] == 0, got
        assert results[0]["save1_async"]["ok"]["steps"] == results[1]["save1_async"]["ok"]["steps"]
        assert CheckpointStore(url).latest().version >= 1

    def test_async_save_holds_the_state_as_it_was_when_save_async_returned(self, two_rank_job):
        url, results = two_rank_job
        for result in results:
            assert_loaded_like(result, "load1", make_state(SEED, 1))
        assert_same_state(CheckpointStore(url).load(1), make_state(SEED, 1))
        assert_same_state(
            CheckpointStore(url).load_rank_state(1, rank=1, world_size=2), make_rank_state(SEED, 1, 1)
        )


# -- failures ------------------------------------------------------------------------------------


@pytest.mark.crash
class TestRankKilledMidSave:
    @pytest.mark.parametrize("victim", [1, 0])
    def test_previous_version_stays_latest_and_a_retry_commits(self, tmp_path, victim):
        """Bug: the surviving rank raised gloo's bare RuntimeError ("Connection closed by peer"),
        outside the CheckpointError hierarchy; it now raises RankFailedError."""
        url = str(tmp_path / "store")
        job = Job.start("crash", 2, url, tmp_path / "crash", "--victim", str(victim), "--timeout", "20")
        try:
            job.wait_for(f"blocked-r{victim}")  # its first shard of v1 is written, the rest is not
            job.kill(victim)
            job.wait(timeout=40)  # the survivor must give up by itself
        finally:
            job.reap()
        survivor = 1 - victim
        results = job.results()
        assert ok(results[survivor], "save0")["version"] == 0
        error = failed(results[survivor], "save1")
        assert error["error"] == "RankFailedError" and error["cause"] == "RuntimeError", error
        assert "died or timed out" in error["message"], error
        assert error["seconds"] < 15, error  # the peer's closed connection, not the 20 s timeout
        assert results[survivor].get("done"), job.logs()

        store = CheckpointStore(url)
        assert store.latest().version == 0
        assert [v.version for v in store.versions()] == [0]
        assert (Path(url) / "latest").read_text().strip() == "v000000"
        assert list_dirs(store.loc) == {0: True, 1: False}
        written = sorted(plain_name(p.name) for p in (Path(url) / "v000001").iterdir())
        assert f"shard-r{victim}-00.h5" in written and f"shard-r{victim}-01.h5" not in written, written
        assert store.gc() == [1]
        assert not (Path(url) / "v000001").exists()

        Job.run("save", 2, url, tmp_path / "retry", "--version", "1")
        assert store.latest().version == 1
        assert_same_state(store.load(1), make_state(SEED, 1))
        for rank in (0, 1):
            assert_same_state(
                store.load_rank_state(1, rank=rank, world_size=2), make_rank_state(SEED, 1, rank)
            )


class TestRankFailures:
    def test_a_failing_write_fails_every_rank_and_commits_nothing(self, tmp_path):
        url = str(tmp_path / "store")
        results = Job.run("failing", 2, url, tmp_path / "job", "--victim", "1")
        own = failed(results[1], "save1")
        assert own["error"] == "OSError" and "injected I/O error" in own["message"], own
        other = failed(results[0], "save1")
        assert other["error"] == "RankFailedError", other
        assert "rank 1" in other["message"] and "injected I/O error" in other["message"], other
        seen = ok(results[0], "after_failure")
        assert seen["versions"] == [0]
        # Bug fix: every rank's partial files stayed (and kept a full disk full) until gc's grace
        # period; rank 0 now removes them once every rank has reported.
        assert 1 not in seen["dirs"]
        for result in results:  # the same job saves the same version again: the leftovers go
            assert ok(result, "retry1")["version"] == 1
        store = CheckpointStore(url)
        assert [v.version for v in store.versions()] == [0, 1]
        assert_same_state(store.load(1), make_state(SEED, 1))

    @pytest.mark.parametrize("leave", [96 << 10, 0], ids=["part-written", "nothing-free"])
    def test_a_save_that_fills_the_disk_removes_every_ranks_partial_files(self, tmp_path, leave):
        """On a real full disk (a tmpfs) at W=2, a save and a save_async of the replicated state fail
        with the disk's error, and once every rank has reported, rank 0 removes every rank's partial
        files and the claim: the disk has its free space back and version 0 is intact. Nothing free
        at all: the claim itself fails, and leaves neither its temporary file nor its directory."""
        with small_tmpfs(tmp_path / "disk", "2m") as disk:
            url = str(disk / "store")
            Job.run("save", 2, url, tmp_path / "first", "--version", "0")
            fill(disk, leave=leave)
            before, free = files_under(disk / "store"), free_bytes(disk)
            results = Job.run("full_disk", 2, url, tmp_path / "job", "--version", "1")
            for step in ("save", "save_async"):
                errors = [failed(result, step) for result in results]
                assert any("no space left on the device" in e["message"] for e in errors), errors
                left, free_after = ok(results[0], f"after_{step}")
                assert left == before, f"{step} left {sorted(set(left) - set(before))}"
                assert free_after == free, (step, free_after, free)
            assert files_under(disk / "store") == before and free_bytes(disk) == free
            store = CheckpointStore(url)
            assert [v.version for v in store.versions()] == [0]
            assert_same_state(store.load(0), make_state(SEED, 0))

    def test_different_replicated_states_are_refused_before_writing(self, tmp_path):
        url = str(tmp_path / "store")
        results = Job.run("mismatch", 2, url, tmp_path / "job")
        first = failed(results[0], "save1")
        assert first["error"] == "CheckpointError", first
        assert "rank(s) [1]" in first["message"] and "differs from rank 0" in first["message"], first
        second = failed(results[1], "save1")
        assert second["error"] == "RankFailedError", second
        assert "rank(s) [1]" in second["message"], second
        seen = ok(results[0], "after_failure")
        assert seen == {"versions": [0], "dirs": [0]}  # nothing was written
        for result in results:
            assert ok(result, "retry1")["version"] == 1

    def test_an_unstorable_rank_state_on_one_rank_fails_every_rank_without_hanging(self, tmp_path):
        """Bug: a rank whose own state could not be encoded raised before the first collective,
        so the other ranks waited in it for the group's timeout (10 minutes by default), or
        paired it with that rank's next save."""
        url = str(tmp_path / "store")
        results = Job.run("bad_rank_state", 2, url, tmp_path / "job", "--timeout", "30")
        own = failed(results[1], "save0")
        assert own["error"] == "UnsupportedValueError", own
        other = failed(results[0], "save0")
        assert other["error"] == "RankFailedError", other
        assert "rank 1" in other["message"] and "UnsupportedValueError" in other["message"], other
        assert other["seconds"] < 10, other
        assert ok(results[0], "after_failure") == {"versions": [], "dirs": []}
        for result in results:
            assert ok(result, "retry0")["version"] == 0


# -- S3 ------------------------------------------------------------------------------------------


@pytest.mark.s3
class TestS3:
    def test_two_ranks_save_and_load_on_s3(self, s3_bucket, tmp_path):
        bucket, options = s3_bucket
        url = f"s3://{bucket}/run1"
        results = Job.run("roundtrip", 2, url, tmp_path / "job", storage_options=options)
        for rank, result in enumerate(results):
            for v in (0, 1):
                assert_loaded_like(result, f"load{v}", make_state(SEED, v))
                assert ok(result, f"rank_state{v}")["digest"] == want_digest(make_rank_state(SEED, v, rank))
        store = CheckpointStore(url, storage_options=options)
        assert [v.version for v in store.versions()] == [0, 1]
        assert_same_state(store.load(0), make_state(SEED, 0))
        assert sorted(replicated_bytes_by_rank(store, 0)) == [0, 1]
        with pytest.warns(RankStateWarning):
            assert_same_state(store.load_rank_state(1), make_rank_state(SEED, 1, 0))


# -- one process ---------------------------------------------------------------------------------


class TestSingleProcess:
    def test_save_without_rank_state_leaves_out_the_rank_fields(self, tmp_path):
        store = CheckpointStore(tmp_path / "store", options=StoreOptions(shards=2, shard_bytes=1))
        store.save(make_state(SEED, 0), epoch=0)
        raw = json.loads((tmp_path / "store" / "v000000" / "manifest.json").read_bytes())
        assert raw["format_version"] == SHARED_FORMAT_VERSION  # content keys
        assert "ranks" not in raw and "world_size" not in raw
        assert all(s["file"].startswith("shard-r0-") for s in raw["shards"])
        assert store.load_rank_state(0) is None
        assert_same_state(store.load(0), make_state(SEED, 0))

    def test_save_with_rank_state_round_trips(self, tmp_path):
        store = CheckpointStore(tmp_path / "store", options=StoreOptions(shards=2, shard_bytes=1))
        own = make_rank_state(SEED, 0, 0)
        store.save(make_state(SEED, 0), epoch=0, rank_state=own)
        raw = json.loads((tmp_path / "store" / "v000000" / "manifest.json").read_bytes())
        assert raw["format_version"] == SHARED_FORMAT_VERSION
        assert raw["world_size"] == 1 and len(raw["ranks"]) == 1
        fresh = CheckpointStore(tmp_path / "store")
        got = fresh.load_rank_state(0)
        assert_same_state(got, own)
        assert_tensors_equal(got, own)
        assert_same_state(fresh.load(0), make_state(SEED, 0))
