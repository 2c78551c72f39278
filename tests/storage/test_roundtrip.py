"""Round trip: what is saved comes back bit for bit, with the same types, on every backend."""

from __future__ import annotations

import io
import json
import math
import random

import h5py
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from ckptflow.storage import (
    CorruptShardError,
    VersionExistsError,
    VersionNotFoundError,
)
from ckptflow.storage.format.dtypes import SUPPORTED
from tests.conftest import assert_same_state, tensor_bits

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")

# -- strategies -----------------------------------------------------------------------------------

DTYPES = sorted(SUPPORTED, key=str)
NUMPY_DTYPES = ["?", "u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "f2", "f4", "f8", "c8", "c16"]
shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)


@st.composite
def tensors(draw) -> torch.Tensor:
    """Any supported dtype, any bit pattern (NaN payloads, subnormals...), shapes incl. 0-d and empty."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes)
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        t = torch.tensor(draw(st.lists(st.booleans(), min_size=numel, max_size=numel))).reshape(shape)
    else:
        width = torch.empty((), dtype=dtype).element_size()
        raw = draw(st.binary(min_size=numel * width, max_size=numel * width))
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, -1)  # non-contiguous
    return t


@st.composite
def arrays(draw) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = draw(shapes)
    numel = math.prod(shape)
    if dtype.kind == "b":
        return np.array(draw(st.lists(st.booleans(), min_size=numel, max_size=numel)), dtype=bool).reshape(
            shape
        )
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # nan, inf, -0.0 included
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
keys = st.text(max_size=6) | st.integers(-3, 1000)
trees = st.recursive(
    scalars | tensors() | arrays(),
    lambda kids: (
        st.lists(kids, max_size=3)
        | st.lists(kids, max_size=3).map(tuple)
        | st.dictionaries(keys, kids, max_size=3)
    ),
    max_leaves=12,
)
states = st.dictionaries(st.text(min_size=1, max_size=6), trees, max_size=4)


class TestRoundTripProperty:
    def test_random_states_come_back_bit_for_bit(self, store_url):
        store = store_url.open(shards=3, threads=2, shard_bytes=1)

        @settings(
            max_examples=15 if store_url.is_s3 else 60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(state=states)
        def check(state):
            info = store.save(state)
            assert_same_state(store.load(info.version), state)

        check()


# -- specific kinds of state ----------------------------------------------------------------------


class TestOddKeys:
    def test_keys_that_are_hard_to_name_in_hdf5_or_json(self, store_url):
        """Bug fixed: a key holding a NUL failed the save inside HDF5 and left a half-written version."""
        state = {
            "\x00": torch.ones(2),
            "": torch.zeros(1),
            ".": torch.ones(1),
            "..": torch.ones(1),
            "a/b": torch.full((1,), 1.0),
            "a": {"b": torch.full((1,), 2.0)},
            "a.b": torch.full((1,), 3.0),
            "$tensor": torch.full((1,), 4.0),
            "ünï ☃": torch.full((1,), 5.0),
            7: {-1: torch.full((1,), 6.0)},
        }
        out, info, store = _round_trip(store_url, state)
        assert_same_state(out, state)
        names = [b.dataset for b in store.manifest(info.version).blobs]
        assert len(set(names)) == len(names) == 10


def _round_trip(target, state, **options):
    store = target.open(**options)
    info = store.save(state)
    return store.load(info.version), info, store


class TestViewsAndSharing:
    def test_non_contiguous_views_store_only_their_own_elements(self, store_url):
        state = {
            "transposed": torch.randn(5, 7).t(),
            "strided": torch.randn(6, 9)[1::2, ::3],
            "expanded": torch.randn(3, 1).expand(3, 4),
            "negative_offset_slice": torch.arange(50, dtype=torch.int16)[40:],
        }
        out, info, _ = _round_trip(store_url, state)
        assert_same_state(out, state)
        assert info.nbytes == sum(t.numel() * t.element_size() for t in state.values())

    def test_a_tiny_slice_of_a_huge_tensor_makes_a_tiny_checkpoint(self, store_url):
        huge = torch.randn(2_000_000)  # 8 MB
        out, info, _ = _round_trip(store_url, {"s": huge[1000:1003]})
        assert torch.equal(out["s"], huge[1000:1003])
        assert info.nbytes == 12
        assert info.size < 64 * 1024

    def test_tied_weights_come_back_as_one_tensor(self, store_url):
        w = torch.randn(4, 3)
        out, info, store = _round_trip(store_url, {"a": w, "b": w, "c": {"d": w}})
        assert out["a"] is out["b"] is out["c"]["d"]
        assert torch.equal(out["a"], w)
        assert len(store.manifest(info.version).blobs) == 1

    def test_overlapping_views_share_memory_after_loading(self, store_url):
        buf = torch.arange(30, dtype=torch.float32)
        x, y = buf[2:12], buf[8:20].view(3, 4)
        out, info, store = _round_trip(store_url, {"x": x, "y": y})
        assert_same_state(out, {"x": x, "y": y})
        [blob] = store.manifest(info.version).blobs
        assert blob.nbytes == 18 * 4  # elements 2..19, not the whole buffer
        out["x"][7] = -1.0  # buf[9] == y[0, 1]
        assert out["y"][0, 1].item() == -1.0
        assert out["x"].untyped_storage().data_ptr() == out["y"].untyped_storage().data_ptr()

    def test_tied_module_weights_survive_load_state_dict(self, store_url):
        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(10, 4)
                self.head = nn.Linear(4, 10, bias=False)
                self.head.weight = self.emb.weight

        model = Tied()
        out, _, _ = _round_trip(store_url, {"model": model.state_dict()})
        assert out["model"]["emb.weight"] is out["model"]["head.weight"]
        fresh = Tied()
        fresh.load_state_dict(out["model"])
        assert fresh.head.weight is fresh.emb.weight
        assert torch.equal(fresh.emb.weight, model.emb.weight)

    def test_numpy_arrays_come_back_as_numpy_with_their_dtype(self, store_url):
        rng = np.random.default_rng(0)
        state = {
            "f32": rng.standard_normal((3, 4)).astype(np.float32),
            "f16": rng.standard_normal(5).astype(np.float16),
            "i8": rng.integers(-100, 100, 7).astype(np.int8),
            "u64": np.array([2**64 - 1, 0, 12345], dtype=np.uint64),
            "bool": np.array([True, False, True]),
            "c128": (rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex128),
            "scalar": np.array(3.5),
            "empty": np.zeros((0, 3), dtype=np.int32),
            "strided": np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2],
        }
        out, _, _ = _round_trip(store_url, state)
        assert_same_state(out, state)

    def test_zero_dim_numpy_array_keeps_its_shape(self, tmp_path):
        """Bug fixed: a 0-d numpy array came back with shape (1,) (np.ascontiguousarray makes it 1-d)."""
        from ckptflow.storage import CheckpointStore

        store = CheckpointStore(tmp_path)
        store.save({"a": np.array(7, dtype=np.int16), "b": np.float64(2.5)})
        out = store.load()
        assert out["a"].shape == () and out["a"].dtype == np.int16 and out["a"].item() == 7
        assert out["b"] == 2.5 and type(out["b"]) is float  # numpy scalars are stored as numbers

    def test_big_endian_arrays_come_back_native_with_the_same_values(self, tmp_path):
        from ckptflow.storage import CheckpointStore

        store = CheckpointStore(tmp_path)
        a = np.arange(6, dtype=">i4")
        store.save({"a": a})
        out = store.load()["a"]
        assert out.dtype == np.dtype("<i4")
        assert np.array_equal(out, a)


class TestRandomState:
    def test_numpy_global_rng_state(self, store_url):
        np.random.seed(1234)
        np.random.standard_normal(3)  # also leaves a cached gaussian in the state
        state = np.random.get_state()
        expected = np.random.random(5)
        out, _, _ = _round_trip(store_url, {"np": state})
        assert_same_state(out["np"], state)
        np.random.set_state(out["np"])
        assert np.random.random(5).tobytes() == expected.tobytes()

    def test_numpy_generator_state_with_128_bit_integers(self, store_url):
        rng = np.random.default_rng(99)
        rng.random(3)
        state = rng.bit_generator.state
        expected = rng.random(4)
        out, _, _ = _round_trip(store_url, {"gen": state})
        assert_same_state(out["gen"], state)
        restored = np.random.default_rng()
        restored.bit_generator.state = out["gen"]
        assert restored.random(4).tobytes() == expected.tobytes()

    def test_python_random_state(self, store_url):
        random.seed(42)
        state = random.getstate()
        expected = [random.random() for _ in range(5)]
        out, _, _ = _round_trip(store_url, {"py": state})
        assert_same_state(out["py"], state)
        random.setstate(out["py"])
        assert [random.random() for _ in range(5)] == expected

    def test_torch_rng_state(self, store_url):
        torch.manual_seed(7)
        state = torch.get_rng_state()
        gen = torch.Generator().manual_seed(3)
        gen_state = gen.get_state()
        expected = torch.randn(5)
        expected_gen = torch.randn(5, generator=gen)
        out, _, _ = _round_trip(store_url, {"torch": state, "gen": gen_state})
        torch.set_rng_state(out["torch"])
        assert tensor_bits(torch.randn(5)) == tensor_bits(expected)
        gen.set_state(out["gen"])
        assert tensor_bits(torch.randn(5, generator=gen)) == tensor_bits(expected_gen)


def _make_training(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


class TestTrainingState:
    def test_model_optimizer_scheduler_resume_bit_identical(self, store_url):
        model, opt, sched = _make_training(0)
        _train(model, opt, sched, 3, seed=1)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
        out, _, _ = _round_trip(store_url, state)
        assert_same_state(out, state)
        assert list(out["optimizer"]["state"]) == [0, 1, 2, 3, 4, 5]  # int keys
        assert isinstance(out["optimizer"]["param_groups"][0]["betas"], tuple)

        model2, opt2, sched2 = _make_training(1)  # different init: everything must come from the checkpoint
        model2.load_state_dict(out["model"])
        opt2.load_state_dict(out["optimizer"])
        sched2.load_state_dict(out["scheduler"])
        _train(model, opt, sched, 3, seed=2)
        _train(model2, opt2, sched2, 3, seed=2)
        assert_same_state(model2.state_dict(), model.state_dict())
        assert_same_state(opt2.state_dict(), opt.state_dict())
        assert sched2.get_last_lr() == sched.get_last_lr()


# -- partial load ---------------------------------------------------------------------------------


def _flip_byte(target, rel: str, offset: int) -> None:
    data = bytearray(target.raw_read(rel))
    data[offset] ^= 0xFF
    target.raw_write(rel, bytes(data))


class TestPartialLoad:
    def _state(self):
        model, opt, _ = _make_training(0)
        _train(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1), 1, seed=0)
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 4}

    def test_returns_only_the_requested_keys(self, store_url):
        state = self._state()
        store = store_url.open()
        store.save(state)
        out = store.load(keys=["model"])
        assert list(out) == ["model"]
        assert_same_state(out["model"], state["model"])
        out = store.load(keys=["optimizer/param_groups", "epoch"])
        assert_same_state(
            out, {"optimizer": {"param_groups": state["optimizer"]["param_groups"]}, "epoch": 4}
        )

    def test_an_int_keyed_entry_keeps_its_int_key(self, store_url):
        """Bug fixed: ``load(keys=["optimizer/state/0"])`` came back keyed by the string "0"."""
        state = self._state()
        store = store_url.open()
        store.save(state)
        out = store.load(keys=["optimizer/state/0"])
        assert_same_state(out, {"optimizer": {"state": {0: state["optimizer"]["state"][0]}}})
        opt_state = store.load(keys=["optimizer/state"])["optimizer"]["state"]
        assert_same_state(opt_state, state["optimizer"]["state"])

    def test_reads_only_the_bytes_of_the_requested_keys(self, store_url):
        state = self._state()
        store = store_url.open(shards=1)  # one shard: the corrupt bytes sit in the file the load reads
        info = store.save(state)
        manifest = store.manifest(info.version)
        entry = next(t for t in manifest.tensors if t.path == "optimizer/state/0/exp_avg")
        blob = manifest.blobs[entry.blob]
        assert blob.nbytes > 0
        model_blobs = {t.blob for t in manifest.tensors if t.path.startswith("model/")}
        assert entry.blob not in model_blobs
        _flip_byte(store_url, f"v{info.version:06d}/{manifest.shards[blob.shard].file}", blob.offset + 1)

        fresh = store_url.open()
        out = fresh.load(keys=["model"])
        assert_same_state(out["model"], state["model"])
        with pytest.raises(CorruptShardError, match=r"optimizer\.state\.0\.exp_avg"):
            fresh.load()
        with pytest.raises(CorruptShardError):
            fresh.load(keys=["optimizer"])

    def test_missing_key_is_named(self, store_url):
        store = store_url.open()
        store.save({"model": {"w": torch.ones(1)}})
        with pytest.raises(KeyError, match="model/nope"):
            store.load(keys=["model/nope"])


# -- versions -------------------------------------------------------------------------------------


class TestVersions:
    def test_versions_latest_and_manifest_after_several_saves(self, store_url):
        store = store_url.open()
        assert store.versions() == []
        assert store.latest() is None
        for epoch in range(3):
            store.save(
                {"w": torch.full((2,), float(epoch))},
                epoch=epoch,
                step=100 * epoch,
                metrics={"loss": 1.0 / (epoch + 1)},
                user={"note": f"e{epoch}"},
            )
        listed = store.versions()
        assert [v.version for v in listed] == [0, 1, 2]
        assert [v.epoch for v in listed] == [0, 1, 2]
        assert [v.step for v in listed] == [0, 100, 200]
        assert [v.metrics for v in listed] == [{"loss": 1.0}, {"loss": 0.5}, {"loss": 1 / 3}]
        assert [v.user["note"] for v in listed] == ["e0", "e1", "e2"]
        assert all(v.nbytes == 8 and v.size > 8 for v in listed)
        assert listed[1].url.endswith("/v000001")
        assert store.latest() == listed[-1]
        manifest = store.manifest(1)
        assert (manifest.version, manifest.epoch, manifest.metrics) == (1, 1, {"loss": 0.5})
        assert store.manifest().version == 2
        assert torch.equal(store.load()["w"], torch.full((2,), 2.0))
        assert torch.equal(store.load(0)["w"], torch.zeros(2))
        assert store_url.raw_read("latest") == b"v000002\n"

    def test_explicit_version_and_numbering_after_it(self, store_url):
        store = store_url.open()
        store.save({"a": 1}, version=10)
        info = store.save({"a": 2})
        assert info.version == 11
        assert [v.version for v in store.versions()] == [10, 11]
        store.save({"a": 3}, version=5)  # a gap below is fine
        assert [v.version for v in store.versions()] == [5, 10, 11]
        assert store.latest().version == 11
        assert store_url.raw_read("latest") == b"v000011\n"
        assert store.load(5) == {"a": 3}
        assert store.load() == {"a": 2}

    def test_saving_over_a_committed_version_is_refused(self, store_url):
        store = store_url.open()
        store.save({"w": torch.ones(3)}, version=2)
        with pytest.raises(VersionExistsError, match="version 2 is already committed"):
            store.save({"w": torch.zeros(3)}, version=2)
        assert torch.equal(store.load(2)["w"], torch.ones(3))
        assert [v.version for v in store.versions()] == [2]

    def test_loading_a_version_that_does_not_exist(self, store_url):
        store = store_url.open()
        store.save({"a": 1})
        with pytest.raises(VersionNotFoundError, match="version 3 is not committed"):
            store.load(3)

    @pytest.mark.parametrize(
        ("metrics", "message"),
        [
            ({"loss": float("nan")}, "metric 'loss' must be finite"),
            ({"ok": 1.0, "acc": float("inf")}, "metric 'acc' must be finite"),
            ({"loss": "low"}, "metric 'loss' must be a number"),
            ({"loss": None}, "metric 'loss' must be a number"),
            ({"loss": torch.tensor(float("-inf"))}, "metric 'loss' must be finite"),
        ],
    )
    def test_metrics_must_be_finite_numbers(self, tmp_path, metrics, message):
        from ckptflow.storage import CheckpointStore

        store = CheckpointStore(tmp_path / "store")
        with pytest.raises(ValueError, match=message):
            store.save({"a": torch.ones(1)}, metrics=metrics)
        assert store.versions() == []
        assert not (tmp_path / "store").exists()

    def test_metrics_accept_numpy_and_tensor_scalars(self, tmp_path):
        from ckptflow.storage import CheckpointStore

        store = CheckpointStore(tmp_path)
        info = store.save({}, metrics={"a": np.float32(0.5), "b": torch.tensor(2), "c": 3})
        assert info.metrics == {"a": 0.5, "b": 2.0, "c": 3.0}


# -- the files themselves -------------------------------------------------------------------------


class TestShardFiles:
    def test_shards_are_plain_hdf5(self, store_url):
        w = torch.randn(3, 5)
        h = torch.randn(4).to(torch.bfloat16)
        store = store_url.open(shards=2, shard_bytes=1)
        info = store.save({"model": {"w": w, "h": h}})
        manifest = store.manifest(info.version)
        files = {}
        for tensor in manifest.tensors:
            blob = manifest.blobs[tensor.blob]
            files[tensor.path] = (manifest.shards[blob.shard].file, blob.dataset)
        assert files["model/w"][1] == "model.w"

        def open_h5(name):
            return h5py.File(io.BytesIO(store_url.raw_read(f"v{info.version:06d}/{name}")), "r")

        with open_h5(files["model/w"][0]) as f:
            assert f.attrs["format"] == "ckptflow-shard"
            ds = f["model.w"]
            assert ds.dtype == np.float32
            assert ds.attrs["torch_dtype"] == "float32"
            assert np.array_equal(ds[()], w.numpy())
        with open_h5(files["model/h"][0]) as f:
            ds = f["model.h"]
            assert ds.dtype == np.uint16  # bfloat16 bits, untouched
            assert ds.attrs["torch_dtype"] == "bfloat16"
            assert ds[()].tobytes() == tensor_bits(h)

    def test_manifest_is_json_with_sizes_and_checksums(self, store_url):
        import xxhash

        store = store_url.open(shards=2, shard_bytes=1)
        info = store.save({"a": torch.randn(100), "b": torch.randn(50)})
        raw = json.loads(store_url.raw_read(f"v{info.version:06d}/manifest.json"))
        assert raw["format"] == "ckptflow-checkpoint"
        assert raw["checksum_algorithm"] == "xxh3_64"
        assert len(raw["shards"]) == 2
        for shard in raw["shards"]:
            data = store_url.raw_read(f"v{info.version:06d}/{shard['file']}")
            assert len(data) == shard["size"]
            assert xxhash.xxh3_64_hexdigest(data) == shard["checksum"]
        assert sum(s["size"] for s in raw["shards"]) == info.size


class TestNoCredentialsStored:
    def test_secret_never_reaches_the_manifest_or_listings(self, s3_bucket):
        from ckptflow.storage import CheckpointStore
        from tests.conftest import S3_SECRET, StoreTarget

        bucket, options = s3_bucket
        assert options["secret"] == S3_SECRET
        target = StoreTarget("s3", f"s3://{bucket}/run", options)
        store = CheckpointStore(target.url, storage_options=options)
        info = store.save({"w": torch.ones(2)}, metrics={"loss": 0.1}, user={"run": "r1"})

        assert S3_SECRET.encode() not in target.raw_read(f"v{info.version:06d}/manifest.json")
        assert S3_SECRET.encode() not in target.raw_read("latest")
        for v in store.versions():
            assert S3_SECRET not in repr(v)
            assert v.url == f"s3://{bucket}/run/v000000"
        assert S3_SECRET not in store.url
        assert S3_SECRET not in repr(store)
        assert S3_SECRET not in store.manifest().model_dump_json()
