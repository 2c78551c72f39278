"""The files a save writes, read by other tools: shards by h5py and h5dump, manifests by older rules.

Shards are HDF5 files whose metadata ckptflow encodes itself (storage/format/h5layout.py); these
tests open them with the HDF5 library (through h5py) and with HDF5's own ``h5dump``, for every
dtype ckptflow stores, every shape kind, and more datasets than one symbol table node holds.
Manifests are compact JSON sealed over their bytes (format 6); those of format 5 (indented,
sealed over sorted keys) still load.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from ckptflow.storage import CheckpointStore, ManifestError, StoreOptions
from ckptflow.storage.format.dtypes import SUPPORTED, dtype_name, storage_dtype
from ckptflow.storage.format.manifest import SEAL_KEY, parse_manifest, seal
from tests.conftest import assert_same_state, tensor_bits


def _every_dtype() -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for dtype in sorted(SUPPORTED, key=str):
        bits = torch.arange(64, dtype=torch.uint8)  # every width divides 64 into an even count
        if dtype == torch.bool:
            bits = bits % 2
        state[dtype_name(dtype)] = bits.view(dtype).reshape(2, -1)
    state["scalar"] = torch.tensor(7, dtype=torch.int64)
    state["empty"] = torch.zeros(0, 3)
    state["odd.uint8"] = torch.arange(5, dtype=torch.uint8)  # 5 bytes: the next dataset is realigned
    state["after.odd"] = torch.arange(3, dtype=torch.float64)
    state["nested/key with spaces"] = torch.ones(2, 2, 2)
    return state


def _shards(store: CheckpointStore, version: int) -> list[Path]:
    manifest = store.manifest(version)
    return [Path(store.url) / f"v{version:06d}" / s.file for s in manifest.shards]


def _datasets(store: CheckpointStore, version: int) -> dict[str, tuple[Path, str]]:
    """Tensor path -> (shard file, dataset name), from the manifest."""
    manifest = store.manifest(version)
    files = _shards(store, version)
    return {
        t.path: (files[manifest.blobs[t.blob].shard], manifest.blobs[t.blob].dataset)
        for t in manifest.tensors
    }


class TestShardsAreHdf5:
    def test_the_datatype_table_is_what_hdf5_encodes(self):
        """ckptflow writes datatype messages from a table (no HDF5 call on a save): HDF5's own."""
        from h5py import h5t

        from ckptflow.storage.format.dtypenames import NATIVE, UINT_OF_WIDTH
        from ckptflow.storage.format.h5layout import DATATYPES, STRING_TYPE

        assert set(DATATYPES) == set(NATIVE.values()) | set(UINT_OF_WIDTH.values())
        for code, message in DATATYPES.items():
            assert h5t.py_create(np.dtype(code)).encode()[2:] == message, code
        in_memory = h5t.py_create(h5py.string_dtype(), logical=True).encode()[2:]
        assert STRING_TYPE[:4] + STRING_TYPE[8:] == in_memory[:4] + in_memory[8:]

    def test_h5py_reads_every_dtype_and_shape(self, tmp_path):
        state = _every_dtype()
        store = CheckpointStore(tmp_path / "store", options=StoreOptions(shards=3))
        info = store.save(state)
        where = _datasets(store, info.version)
        for path, tensor in state.items():
            file, dataset = where[path]
            with h5py.File(file, "r") as f:
                assert f.attrs["format"] == "ckptflow-shard" and f.attrs["format_version"] == 1
                ds = f[dataset]
                assert ds.attrs["torch_dtype"] == dtype_name(tensor.dtype), path
                assert ds.dtype == storage_dtype(tensor.dtype), path
                assert ds.shape == tuple(tensor.shape), path
                assert ds[()].tobytes() == tensor_bits(tensor), path
        assert_same_state(store.load(), state)

    def test_h5dump_reads_every_shard(self, tmp_path):
        state = _every_dtype()
        store = CheckpointStore(tmp_path / "store", options=StoreOptions(shards=2))
        info = store.save(state)
        dumped = ""
        for file in _shards(store, info.version):
            done = subprocess.run(["h5dump", str(file)], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            assert "h5dump error" not in done.stdout + done.stderr
            dumped += done.stdout
        assert '"ckptflow-shard"' in dumped
        assert 'DATASET "float32"' in dumped and 'DATASET "nested.key with spaces"' in dumped
        assert "(0,0): 0, 1, 2, 3, 4, 5" in dumped  # the int8 tensor's first row, read by HDF5 itself

    def test_more_names_than_one_symbol_table_node_holds(self, tmp_path):
        """70,000 datasets in one shard: two symbol table nodes; every name found, in order."""
        count = 70_000
        state = {f"p.{i}": torch.full((2,), float(i)) for i in range(count)}
        store = CheckpointStore(tmp_path / "store", options=StoreOptions(shards=1))
        info = store.save(state)
        (file,) = _shards(store, info.version)
        with h5py.File(file, "r") as f:
            names = list(f)
            assert len(names) == count and names == sorted(names)
            for i in (0, 1, 32_766, 32_767, 65_533, 65_534, 69_999):
                assert f[f"p.{i}"][()].tolist() == [float(i)] * 2
        done = subprocess.run(["h5dump", "-H", str(file)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.count("DATASET ") == count

    def test_a_state_without_tensors_is_an_empty_hdf5_file(self, tmp_path):
        store = CheckpointStore(tmp_path / "store")
        info = store.save({"epoch": 3, "note": "no tensors"})
        (file,) = _shards(store, info.version)
        with h5py.File(file, "r") as f:
            assert list(f) == [] and f.attrs["format"] == "ckptflow-shard"
        assert store.load() == {"epoch": 3, "note": "no tensors"}

    def test_the_same_state_gives_the_same_files(self, tmp_path):
        state = _every_dtype()
        store = CheckpointStore(tmp_path / "store")
        first, second = store.save(state), store.save(state)
        for a, b in zip(_shards(store, first.version), _shards(store, second.version), strict=True):
            assert a.read_bytes() == b.read_bytes()


class TestSmallStates:
    def test_a_small_state_writes_one_shard_and_a_large_one_several(self, tmp_path):
        store = CheckpointStore(tmp_path / "store")  # 4 shards at most, by default
        small = store.save({"w": torch.randn(750_000)})  # 3 MB
        assert len(store.manifest(small.version).shards) == 1
        large = store.save({f"w{i}": torch.randn(16 << 20) for i in range(8)})  # 512 MiB
        assert len(store.manifest(large.version).shards) == 4

    def test_a_save_does_not_list_the_files_of_older_versions(self, tmp_path, monkeypatch):
        """A save's cost must not grow with the versions a store holds: numbering the new version
        lists the root, not every version's files (which slowed every save of a long run)."""
        import os

        from fsspec.implementations.local import LocalFileSystem

        store = CheckpointStore(tmp_path / "store")
        for _ in range(5):
            store.save({"w": torch.randn(4)})
        older = {str(tmp_path / "store" / f"v{v:06d}") for v in range(5)}
        listed: list[str] = []
        real_ls, real_scandir, real_listdir = LocalFileSystem.ls, os.scandir, os.listdir

        def ls(fs, path, *args, **kwargs):
            listed.append(str(path).rstrip("/"))
            return real_ls(fs, path, *args, **kwargs)

        def scandir(path="."):
            listed.append(os.fspath(path).rstrip("/"))
            return real_scandir(path)

        def listdir(path="."):
            listed.append(os.fspath(path).rstrip("/"))
            return real_listdir(path)

        monkeypatch.setattr(LocalFileSystem, "ls", ls)
        monkeypatch.setattr(os, "scandir", scandir)
        monkeypatch.setattr(os, "listdir", listdir)
        store.save({"w": torch.randn(4)})
        assert str(tmp_path / "store") in listed  # the root, to number the version
        assert not older.intersection(listed), sorted(older.intersection(listed))


def _manifest_path(store: CheckpointStore, version: int) -> Path:
    return Path(store.url) / f"v{version:06d}" / "manifest.json"


class TestManifestEncoding:
    def test_written_compact_in_state_order_and_sealed_over_its_bytes(self, tmp_path):
        store = CheckpointStore(tmp_path / "store", options=StoreOptions(dedup=False))
        state = {"z": torch.ones(1), "a": torch.zeros(1), "m": {"k2": 1, "k1": 2}}
        info = store.save(state)
        data = _manifest_path(store, info.version).read_bytes()
        raw = json.loads(data)
        assert raw["format_version"] == 6 and b"\n" not in data.strip()  # no content keys: format 6
        assert list(raw)[-1] == SEAL_KEY
        assert list(store.load()) == ["z", "a", "m"] and list(store.load()["m"]) == ["k2", "k1"]

    def test_a_save_writes_what_the_manifest_schema_writes(self, tmp_path):
        """A save builds its entries as JSON, not as models: its bytes must be exactly those the
        schema (``Manifest``) validates and writes back, on every kind of entry a save makes."""
        store = CheckpointStore(tmp_path / "store")
        base = torch.arange(24, dtype=torch.float32)
        tied = torch.randn(3, 3)
        state = {
            "views": {"a": base[2:10], "b": base.view(4, 6)[:, 1:3], "c": base},  # one blob, strided refs
            "tied": {"x": tied, "y": tied},
            "empty": torch.zeros(0, 5),
            "array": np.arange(6, dtype=np.int16).reshape(2, 3),
            "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
            "meta": {"lr": 0.1, "names": ["p", "q"], (1, 2): "tuple key"},
        }
        info = store.save(
            state, epoch=2, step=7, metrics={"loss": 0.25}, user={"n": "x"}, rank_state={"rng": torch.ones(2)}
        )
        data = _manifest_path(store, info.version).read_bytes()
        manifest = parse_manifest(data, "test")
        assert manifest.to_json() == data
        assert manifest.ranks and any(t.stride is not None for t in manifest.tensors)
        assert_same_state(store.load(), state)

    def test_a_format_5_manifest_still_loads(self, tmp_path):
        """As ckptflow wrote them before format 6: indented, sealed over its keys sorted."""
        store = CheckpointStore(tmp_path / "store")
        state = {"w": torch.randn(4, 4), "b": {"y": 1, "x": [2, 3]}}
        info = store.save(state)
        path = _manifest_path(store, info.version)
        raw = json.loads(path.read_bytes())
        raw.pop(SEAL_KEY)
        raw["format_version"] = 5
        path.write_text(json.dumps(seal(raw, SEAL_KEY, ordered=False), indent=1))
        assert_same_state(CheckpointStore(store.url).load(), state)
        assert CheckpointStore(store.url).verify(info.version).version == info.version

    def test_a_reformatted_manifest_still_loads_and_a_changed_one_is_refused(self, tmp_path):
        store = CheckpointStore(tmp_path / "store")
        state = {"w": torch.randn(8)}
        info = store.save(state, metrics={"loss": 0.5})
        path = _manifest_path(store, info.version)
        raw = json.loads(path.read_bytes())
        path.write_text(json.dumps(raw, indent=2))  # pretty-printed by hand: the same document
        assert_same_state(CheckpointStore(store.url).load(), state)
        raw["metrics"]["loss"] = 0.1
        path.write_text(json.dumps(raw))
        with pytest.raises(ManifestError, match="changed after it was written"):
            CheckpointStore(store.url).load(info.version)

    @pytest.mark.parametrize("count", [20_000])
    def test_many_tensors_round_trip(self, tmp_path, count):
        state = {f"layers.{i}.weight": torch.randn(16) for i in range(count)}
        store = CheckpointStore(tmp_path / "store")
        store.save(state)
        got = CheckpointStore(store.url).load()
        assert list(got) == list(state)
        assert all(np.array_equal(got[k].numpy(), v.numpy()) for k, v in state.items())

    def test_checksums_of_the_wrong_length_are_refused_even_when_they_add_up(self, tmp_path):
        """15 + 17 hex digits join to 32 valid ones: each checksum is still checked on its own."""
        store = CheckpointStore(tmp_path / "store")
        info = store.save({"a": torch.ones(2), "b": torch.zeros(2)})
        path = _manifest_path(store, info.version)
        raw = json.loads(path.read_bytes())
        raw.pop(SEAL_KEY)
        first, second = raw["blobs"][0]["checksum"], raw["blobs"][1]["checksum"]
        raw["blobs"][0]["checksum"], raw["blobs"][1]["checksum"] = first[:15], first[15:] + second
        path.write_text(json.dumps(seal(raw, SEAL_KEY)))
        with pytest.raises(ManifestError, match=r"blobs\[0\]\.checksum"):
            CheckpointStore(store.url).load(info.version)

    def test_nan_in_a_manifest_is_refused(self, tmp_path):
        """JSON has no NaN; a manifest holding one (sealed over its bytes) was not written by ckptflow."""
        store = CheckpointStore(tmp_path / "store")
        info = store.save({"a": torch.ones(2)}, user={"note": 1.5})
        path = _manifest_path(store, info.version)
        raw = json.loads(path.read_bytes())
        raw.pop(SEAL_KEY)
        body = json.dumps(raw, separators=(",", ":")).replace('"note":1.5', '"note":NaN').encode()
        from ckptflow.storage.format.checksum import digest

        path.write_bytes(body[:-1] + b',"' + SEAL_KEY.encode() + b'":"' + digest(body).encode() + b'"}')
        with pytest.raises(ManifestError, match="it holds NaN, which JSON does not have"):
            CheckpointStore(store.url).load(info.version)


class TestSignBitViews:
    @pytest.mark.parametrize("how", ["save", "save_async"])
    def test_conjugate_and_negative_views_keep_their_values(self, tmp_path, how):
        """Bug fixed: a conjugate (or negative) view was written from its memory, which holds the
        value before the flip: 1+2j came back as 1-2j, with a checksum that agreed."""
        z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
        x = torch.tensor([1.0, -2.0])
        state = {"conj": z.conj(), "neg": x._neg_view(), "z": z}
        store = CheckpointStore(tmp_path / "store")
        if how == "save":
            store.save(state)
        else:
            store.save_async(state).wait()
        got = CheckpointStore(store.url).load()
        assert got["conj"].tolist() == [1 - 2j, 3 + 4j]
        assert got["neg"].tolist() == [-1.0, 2.0]
        assert got["z"].tolist() == [1 + 2j, 3 - 4j]
