"""Corruption is detected, named and never loaded silently; an unreadable manifest hides a version."""

from __future__ import annotations

import json

import pytest
import torch
import xxhash

from ckptflow.storage import (
    CorruptShardError,
    FormatVersionError,
    ManifestError,
    VersionNotFoundError,
)
from tests.conftest import assert_same_state, tensor_bits


@pytest.fixture(autouse=True, params=["one-pass", "read-then-hash"])
def read_path(request, monkeypatch):
    """Both ways a verified load reads: local blobs read and hashed in one pass, and larger blobs
    (here: every blob, by lowering the limit) read in ranges and hashed afterwards."""
    from ckptflow.storage.load import reader

    if request.param == "read-then-hash":
        monkeypatch.setattr(reader, "FUSED_MAX", 0)
    return request.param


def _state():
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)},
        "optimizer": {"m": torch.randn(64, 32, generator=gen)},
    }


def _saved(target, **options):
    """A store with two committed versions (0 and 1); corruption goes into version 1."""
    store = target.open(shards=2, shard_bytes=1, **options)
    store.save({"old": torch.arange(5)}, epoch=0)
    state = _state()
    info = store.save(state, epoch=1)
    manifest = store.manifest(info.version)
    return store, state, manifest


def _blob_of(manifest, path: str):
    entry = next(t for t in manifest.tensors if t.path == path)
    return manifest.blobs[entry.blob]


def _flip(target, rel: str, offset: int) -> bytes:
    data = bytearray(target.raw_read(rel))
    data[offset] ^= 0x5A
    target.raw_write(rel, bytes(data))
    return bytes(data)


class TestFlippedByte:
    def test_load_and_verify_name_the_file_and_both_checksums(self, store_url):
        store, _, manifest = _saved(store_url)
        blob = _blob_of(manifest, "model/w")
        shard = manifest.shards[blob.shard]
        data = _flip(store_url, f"v000001/{shard.file}", blob.offset + 100)

        with pytest.raises(CorruptShardError) as err:
            store.load()
        msg = str(err.value)
        assert f"v000001/{shard.file}" in msg and "model.w" in msg
        assert blob.checksum in msg
        assert err.value.expected == blob.checksum
        assert err.value.actual != blob.checksum and err.value.actual in msg

        with pytest.raises(CorruptShardError) as err:
            store.verify(1)
        msg = str(err.value)
        assert err.value.file.endswith(f"v000001/{shard.file}")
        assert err.value.expected == shard.checksum
        assert err.value.actual == xxhash.xxh3_64_hexdigest(data)
        assert shard.checksum in msg and xxhash.xxh3_64_hexdigest(data) in msg

    def test_load_without_verify_returns_the_corrupt_bytes(self, store_url):
        store, state, manifest = _saved(store_url)
        blob = _blob_of(manifest, "model/w")
        _flip(store_url, f"v000001/{manifest.shards[blob.shard].file}", blob.offset + 100)

        out = store.load(verify=False)
        assert_same_state(out["model"]["b"], state["model"]["b"])
        assert_same_state(out["optimizer"], state["optimizer"])
        got, want = tensor_bits(out["model"]["w"]), tensor_bits(state["model"]["w"])
        assert got != want
        assert [i for i in range(len(want)) if got[i] != want[i]] == [100]
        assert got[100] == want[100] ^ 0x5A

    def test_store_option_verify_on_load_false_also_skips_checks(self, store_url):
        store, _, manifest = _saved(store_url, verify_on_load=False)
        blob = _blob_of(manifest, "optimizer/m")
        _flip(store_url, f"v000001/{manifest.shards[blob.shard].file}", blob.offset)
        store.load()  # no error
        with pytest.raises(CorruptShardError):
            store.load(verify=True)

    def test_a_flip_outside_every_dataset_is_caught_by_verify_and_harmless_to_load(self, store_url):
        store, state, manifest = _saved(store_url)
        shard = manifest.shards[0]
        _flip(store_url, f"v000001/{shard.file}", 0)  # the HDF5 signature
        with pytest.raises(CorruptShardError, match=shard.checksum):
            store.verify(1)
        assert_same_state(store.load(), state)  # every byte load returns is checked

    def test_other_versions_stay_loadable(self, store_url):
        store, _, manifest = _saved(store_url)
        blob = _blob_of(manifest, "model/w")
        _flip(store_url, f"v000001/{manifest.shards[blob.shard].file}", blob.offset)
        assert torch.equal(store.load(0)["old"], torch.arange(5))
        store.verify(0)


class TestTruncatedOrMissingShard:
    def test_truncated_shard(self, store_url):
        store, _, manifest = _saved(store_url)
        shard = manifest.shards[_blob_of(manifest, "model/w").shard]
        rel = f"v000001/{shard.file}"
        store_url.raw_write(rel, store_url.raw_read(rel)[: shard.size // 2])

        for call in (store.load, lambda: store.verify(1)):
            with pytest.raises(CorruptShardError) as err:
                call()
            assert shard.file in err.value.file
            assert f"{shard.size} bytes" in str(err.value)
            assert f"{shard.size // 2} bytes" in str(err.value)

    def test_deleted_shard(self, store_url):
        store, _, manifest = _saved(store_url)
        shard = manifest.shards[1]
        store_url.raw_remove(f"v000001/{shard.file}")

        for call in (store.load, lambda: store.verify(1)):
            with pytest.raises(CorruptShardError) as err:
                call()
            assert err.value.file.endswith(f"v000001/{shard.file}")
            assert "no file" in str(err.value)
        # the version is still listed: its manifest is there, and says what is missing
        assert [v.version for v in store.versions()] == [0, 1]

    def test_partial_load_of_keys_in_an_intact_shard_still_works(self, store_url):
        store, state, manifest = _saved(store_url)
        blob_w = _blob_of(manifest, "model/w")
        blob_m = _blob_of(manifest, "optimizer/m")
        assert blob_w.shard != blob_m.shard  # the planner puts the two big ones apart
        store_url.raw_remove(f"v000001/{manifest.shards[blob_m.shard].file}")
        out = store.load(keys=["model/w"])
        assert_same_state(out, {"model": {"w": state["model"]["w"]}})


def _rewrite_manifest(target, version: int, change) -> None:
    rel = f"v{version:06d}/manifest.json"
    raw = json.loads(target.raw_read(rel))
    change(raw)
    target.raw_write(rel, json.dumps(raw).encode())


class TestUnreadableManifests:
    def test_newer_format_version_is_refused_and_hidden(self, store_url):
        store, _, _ = _saved(store_url)
        _rewrite_manifest(store_url, 1, lambda m: m.update(format_version=99))

        assert [v.version for v in store.versions()] == [0]
        assert store.latest().version == 0
        with pytest.raises(FormatVersionError, match=r"format version 99.*upgrade ckptflow") as err:
            store.load(1)
        assert "v000001/manifest.json" in str(err.value)
        with pytest.raises(FormatVersionError):
            store.verify(1)
        assert torch.equal(store.load()["old"], torch.arange(5))  # the newest readable one
        assert store.gc() == []
        assert store_url.raw_exists("v000001/manifest.json")

    def test_garbage_manifest_is_not_listed_and_not_collected(self, store_url):
        store, _, manifest = _saved(store_url)
        store_url.raw_write("v000001/manifest.json", b"{not json at all")

        assert [v.version for v in store.versions()] == [0]
        with pytest.raises(ManifestError, match=r"v000001/manifest\.json.*not valid JSON"):
            store.load(1)
        assert store.gc() == []
        assert store_url.raw_exists("v000001/manifest.json")
        assert store_url.raw_exists(f"v000001/{manifest.shards[0].file}")
        # a new save does not reuse (or clear) the number of a version it cannot read
        info = store.save({"x": torch.ones(1)})
        assert info.version == 2
        assert store_url.raw_read("v000001/manifest.json") == b"{not json at all"

    @pytest.mark.parametrize(
        "change",
        [
            pytest.param(lambda m: m.pop("shards"), id="missing-field"),
            pytest.param(lambda m: m.update(format="something-else"), id="other-format"),
            pytest.param(lambda m: m["blobs"][0].update(shard=7), id="dangling-shard-ref"),
            pytest.param(lambda m: m.update(version=5), id="wrong-version-number"),
        ],
    )
    def test_invalid_manifest_is_refused_with_a_manifest_error(self, tmp_path, change):
        from tests.conftest import StoreTarget

        target = StoreTarget("local", str(tmp_path / "store"), None)
        store, _, _ = _saved(target)
        _rewrite_manifest(target, 1, change)
        assert [v.version for v in store.versions()] == [0]
        with pytest.raises(ManifestError):
            store.load(1)
        with pytest.raises(VersionNotFoundError, match="committed versions: 0"):
            store.load(2)
