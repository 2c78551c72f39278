"""Retention: prune keeps what the policy says and always the newest; gc removes only garbage."""

from __future__ import annotations

import os
import time

import pytest
import torch

from ckptflow.storage import CheckpointError, CheckpointStore, RetentionPolicy, VersionNotFoundError


def _fill(store, count: int, *, epochs=None, metrics=None) -> None:
    """``count`` small committed versions; version i has epoch ``epochs[i]`` and ``metrics[i]``."""
    for i in range(count):
        store.save(
            {"w": torch.full((4,), float(i))},
            epoch=epochs[i] if epochs is not None else i,
            metrics=metrics[i] if metrics is not None else None,
        )


def _listed(store) -> list[int]:
    return [v.version for v in store.versions()]


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(tmp_path / "store")


class TestPrune:
    def test_keep_last(self, store, tmp_path):
        _fill(store, 6)
        assert store.prune(keep_last=2) == [0, 1, 2, 3]
        assert _listed(store) == [4, 5]
        assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["latest", "v000004", "v000005"]
        assert torch.equal(store.load(4)["w"], torch.full((4,), 4.0))

    def test_keep_every_nth_epoch(self, store):
        _fill(store, 8)
        assert store.prune(keep_every=3) == [1, 2, 4, 5]
        assert _listed(store) == [0, 3, 6, 7]  # 7: the newest

    def test_keep_every_counts_epochs_not_versions(self, store):
        _fill(store, 6, epochs=[10, 11, 12, 13, 14, 15])
        assert store.prune(keep_every=5) == [11, 12, 13, 14]  # versions follow epochs
        assert [v.epoch for v in store.versions()] == [10, 15]

    def test_keep_best_min(self, store):
        _fill(store, 6, metrics=[{"loss": x} for x in (5, 3, 1, 4, 2, 6)])
        assert store.prune(keep_best=("loss", "min")) == [0, 1, 3, 4]
        assert _listed(store) == [2, 5]

    def test_keep_best_max(self, store):
        _fill(store, 5, metrics=[{"acc": x} for x in (0.1, 0.9, 0.5, 0.3, 0.2)])
        assert store.prune(keep_best=("acc", "max")) == [0, 2, 3]
        assert _listed(store) == [1, 4]

    def test_keep_best_prefers_the_newest_of_equals(self, store):
        _fill(store, 4, metrics=[{"loss": x} for x in (1, 3, 1, 2)])
        store.prune(keep_best=("loss", "min"))
        assert _listed(store) == [2, 3]

    def test_keep_best_ignores_versions_without_the_metric(self, store):
        _fill(store, 4, metrics=[{}, {"loss": 9.0}, {"other": 0.0}, {}])
        store.prune(keep_best=("loss", "min"))
        assert _listed(store) == [1, 3]

    def test_best_count(self, store):
        _fill(store, 6, metrics=[{"loss": x} for x in (5, 3, 1, 4, 2, 6)])
        store.prune(RetentionPolicy(keep_best="loss", best_mode="min", best_count=3))
        assert _listed(store) == [1, 2, 4, 5]

    def test_the_newest_is_always_kept(self, store):
        _fill(store, 5, epochs=[0, 1, 2, 3, 5], metrics=[{"loss": x} for x in (1, 2, 3, 4, 99)])
        assert store.prune(keep_best=("loss", "min")) == [1, 2, 3]
        assert _listed(store) == [0, 5]
        store.prune(keep_every=2)
        assert _listed(store) == [0, 5]  # epoch 5 is not a multiple of 2, but it is the newest
        store.prune(keep_last=1)
        assert _listed(store) == [5]
        assert store.latest().version == 5

    def test_a_second_prune_with_the_same_policy_removes_nothing(self, store):
        _fill(store, 5)
        assert store.prune(keep_last=2) == [0, 1, 2]
        assert store.prune(keep_last=2) == []
        assert _listed(store) == [3, 4]

    def test_pruning_an_empty_store(self, store):
        assert store.prune(keep_last=3) == []
        assert store.versions() == []

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({}, "needs at least one of"),
            ({"keep_last": 0}, "keep_last must be >= 1"),
            ({"keep_every": -2}, "keep_every must be >= 1"),
            ({"keep_best": ("loss", "median")}, "best_mode must be 'min' or 'max'"),
        ],
    )
    def test_invalid_policies_are_refused_before_deleting(self, store, kwargs, message):
        _fill(store, 3)
        with pytest.raises(ValueError, match=message):
            store.prune(**kwargs)
        assert _listed(store) == [0, 1, 2]

    def test_keep_best_without_a_direction_is_refused_before_deleting(self, store):
        """Bug fix (issue 34): a keep-best without best_mode silently meant min, so keeping the best
        by an accuracy kept the worst version and deleted the best one."""
        _fill(store, 3, metrics=[{"val_acc": x} for x in (0.6, 0.95, 0.9)])
        with pytest.raises(ValueError, match="keep_best='val_acc' needs best_mode: 'max' if a higher"):
            RetentionPolicy(keep_best="val_acc")
        with pytest.raises(ValueError, match=r"keep_best takes \(metric, 'min' or 'max'\)"):
            store.prune(keep_best="val_acc")  # type: ignore[arg-type]
        assert _listed(store) == [0, 1, 2]
        assert store.prune(keep_best=("val_acc", "max")) == [0]
        assert _listed(store) == [1, 2]


class TestPruneOnEveryBackend:
    def test_combined_policy_and_latest_pointer(self, store_url):
        store = store_url.open()
        losses = [9, 8, 1, 7, 6, 5, 4, 3, 2.5, 2]
        _fill(store, 10, metrics=[{"loss": x} for x in losses])
        removed = store.prune(keep_last=2, keep_every=4, keep_best=("loss", "min"))
        # last 2: 8, 9; every 4th epoch: 0, 4, 8; best loss: 2
        assert removed == [1, 3, 5, 6, 7]
        assert _listed(store) == [0, 2, 4, 8, 9]
        assert store_url.raw_version_dirs() == ["v000000", "v000002", "v000004", "v000008", "v000009"]
        assert store_url.raw_read("latest") == b"v000009\n"
        for v in (1, 5):
            with pytest.raises(VersionNotFoundError):
                store.load(v)
        assert torch.equal(store.load(2)["w"], torch.full((4,), 2.0))


class TestGarbageCollection:
    def test_removes_version_dirs_without_manifest_and_nothing_else(self, store_url):
        store = store_url.open()
        _fill(store, 2)
        store_url.raw_write("v000009/shard-r0-00.h5", b"half a shard")
        store_url.raw_write("v000003/shard-r0-01.h5", b"another")
        store_url.raw_write("notes.txt", b"keep me")
        store_url.raw_write("vfoo/file", b"not a version dir")
        before = sorted(store_url.raw_listdir())

        assert store.gc() == [3, 9]
        assert sorted(store_url.raw_listdir()) == sorted(set(before) - {"v000003", "v000009"})
        assert store_url.raw_read("notes.txt") == b"keep me"
        assert store_url.raw_read("latest") == b"v000001\n"
        assert _listed(store) == [0, 1]
        store.verify(0)
        store.verify(1)
        assert store.gc() == []

    def test_removes_tarballs_without_index_and_keeps_committed_ones(self, store_url):
        """A tar without an index is what a crash during archiving leaves: garbage."""
        store = store_url.open()
        _fill(store, 3)
        store.archive([0, 1])
        store_url.raw_write("archive/epochs-000005-000009.tar", b"half a tar")
        assert store.gc() == []
        names = store_url.raw_listdir("archive")
        assert sorted(names) == ["epochs-000000-000001.index.json", "epochs-000000-000001.tar"]
        store.drop_loose([0, 1])
        assert _listed(store) == [0, 1, 2]
        store.verify(0)

    def test_a_new_store_object_sees_garbage_made_by_another_process(self, store_url):
        """Bug fixed: on S3 the store listed from s3fs's cache and missed versions written by others."""
        store = store_url.open()
        _fill(store, 1)
        assert _listed(store) == [0]
        store_url.raw_write("v000001/shard-r0-00.h5", b"x")
        assert store.gc() == [1]
        other = store_url.open()
        other.save({"w": torch.ones(1)}, version=1)
        assert _listed(store) == [0, 1]  # the first store sees the other's commit

    def test_an_empty_version_dir_is_garbage(self, store, tmp_path):
        _fill(store, 1)
        (tmp_path / "store" / "v000004").mkdir()
        assert store.gc() == [4]
        assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["latest", "v000000"]


class TestGarbageBeingWritten:
    """``gc(min_age=...)`` spares leftovers that changed recently: another process may be saving them."""

    def test_fresh_leftovers_are_spared_and_old_ones_removed(self, store_url):
        store = store_url.open()
        _fill(store, 1)
        store_url.raw_write("v000005/shard-r0-00.h5", b"being written")
        store_url.raw_write("archive/epochs-000007-000008.tar", b"a tarball being written")
        assert store.gc(min_age=3600) == []
        assert store_url.raw_read("v000005/shard-r0-00.h5") == b"being written"
        assert store_url.raw_listdir("archive") == ["epochs-000007-000008.tar"]
        assert store.gc(min_age=0) == [5]
        assert store_url.raw_version_dirs() == ["v000000"]
        assert store_url.raw_listdir("archive") == []

    def test_age_is_that_of_the_newest_file_in_the_version(self, store, tmp_path):
        _fill(store, 1)
        leftover = tmp_path / "store" / "v000003"
        leftover.mkdir()
        for name, age in (("shard-r0-00.h5", 7200), ("shard-r0-01.h5", 30)):
            (leftover / name).write_bytes(b"x")
            then = time.time() - age
            os.utime(leftover / name, (then, then))
        os.utime(leftover, (time.time() - 7200,) * 2)
        assert store.gc(min_age=600) == []  # one shard is still being written
        os.utime(leftover / "shard-r0-01.h5", (time.time() - 900,) * 2)
        assert store.gc(min_age=600) == [3]
        assert not leftover.exists()


class TestCommitChecksShards:
    def test_a_shard_removed_before_the_commit_is_not_committed(self, store_url, monkeypatch):
        """A shard deleted mid-save (``gc`` from another process) must not give a committed version.

        Before, the manifest was written anyway: on S3 a listed version whose shard was gone.
        """
        from ckptflow.storage.versions import commit as protocol

        store = store_url.open(shards=2)
        store.save({"a": torch.ones(1000), "b": torch.zeros(1000)}, epoch=0)
        original = protocol.check_shards_present

        def removed_first(loc, manifest):
            store_url.raw_remove(f"v{manifest.version:06d}/{manifest.shards[0].file}")
            return original(loc, manifest)

        monkeypatch.setattr(protocol, "check_shards_present", removed_first)
        with pytest.raises(
            CheckpointError, match=r"not committing .*v000001: shard files shard-.* are missing"
        ):
            store.save({"a": torch.ones(1000) * 2, "b": torch.zeros(1000)}, epoch=1)
        monkeypatch.undo()
        assert _listed(store) == [0]
        assert not store_url.raw_exists("v000001/manifest.json")
        assert torch.equal(store.load()["a"], torch.ones(1000))
        assert store_url.raw_version_dirs() == ["v000000"]  # the failed save removed its own files
        assert store.gc() == []


class TestDelete:
    def test_delete_a_committed_version(self, store_url):
        store = store_url.open()
        _fill(store, 3)
        store.delete(1)
        assert _listed(store) == [0, 2]
        assert store_url.raw_version_dirs() == ["v000000", "v000002"]
        assert store_url.raw_read("latest") == b"v000002\n"
        with pytest.raises(
            VersionNotFoundError, match=r"version 1 is not committed .*committed versions: 0, 2"
        ):
            store.load(1)

    def test_deleting_the_newest_moves_latest_back(self, store_url):
        store = store_url.open()
        _fill(store, 3)
        store.delete(2)
        assert store_url.raw_read("latest") == b"v000001\n"
        assert store.latest().version == 1
        assert torch.equal(store.load()["w"], torch.full((4,), 1.0))

    def test_deleting_everything_removes_latest(self, store_url):
        store = store_url.open()
        _fill(store, 2)
        store.delete(1)
        store.delete(0)
        assert store.versions() == []
        assert not store_url.raw_exists("latest")
        with pytest.raises(VersionNotFoundError, match="no committed checkpoint"):
            store.load()

    def test_deleting_what_is_not_committed(self, store_url):
        store = store_url.open()
        _fill(store, 2)
        store_url.raw_write("v000005/shard-r0-00.h5", b"garbage")
        for v in (3, 5):
            with pytest.raises(VersionNotFoundError, match="committed versions: 0, 1"):
                store.delete(v)
        assert store_url.raw_exists("v000005/shard-r0-00.h5")  # garbage is gc's business
        assert _listed(store) == [0, 1]

    def test_the_version_number_of_a_deleted_version_can_be_saved_again(self, store_url):
        """Bug fixed: saving an explicit version below the newest pointed ``latest`` at it."""
        store = store_url.open()
        _fill(store, 2)
        store.delete(0)
        store.save({"w": torch.zeros(1)}, version=0)
        assert _listed(store) == [0, 1]
        assert torch.equal(store.load(0)["w"], torch.zeros(1))
        assert store_url.raw_read("latest") == b"v000001\n"
