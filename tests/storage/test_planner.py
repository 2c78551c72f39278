"""Pure planning, no I/O: how blobs are spread over shards, and the JSON structure of a state."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptflow.storage.errors import UnsupportedValueError
from ckptflow.storage.format.structure import Leaf, decode, encode, leaf_refs, select
from ckptflow.storage.save.planner import (
    Blob,
    assign_rank_shards,
    assign_shards,
    dataset_name,
    plan_blobs,
    plan_save,
    shards_per_rank,
)


def _blobs(sizes: list[int]) -> list[Blob]:
    # torch.empty does not touch its memory, so large sizes cost nothing.
    return [
        Blob(i, f"b{i}", torch.uint8, (n,), torch.empty(n, dtype=torch.uint8)) for i, n in enumerate(sizes)
    ]


def _leaves(**tensors: torch.Tensor) -> list[Leaf]:
    return [Leaf(path, t, False) for path, t in tensors.items()]


class TestAssignShards:
    @settings(max_examples=300, deadline=None)
    @given(
        sizes=st.lists(st.integers(0, 5_000_000), max_size=40),
        shards=st.integers(1, 12),
        rank=st.integers(0, 3),
    )
    def test_balanced_complete_and_without_empty_shards(self, sizes, shards, rank):
        plans = assign_shards(_blobs(sizes), shards=shards, rank=rank, shard_bytes=1)

        assigned = sorted(i for p in plans for i in p.blobs)
        assert assigned == list(range(len(sizes))), "every blob exactly once"
        assert [p.index for p in plans] == list(range(len(plans)))
        assert [p.file for p in plans] == [f"shard-r{rank}-{i:02d}.h5" for i in range(len(plans))]
        for p in plans:
            assert p.nbytes == sum(sizes[i] for i in p.blobs)
            assert p.blobs == sorted(p.blobs)
        if not sizes:
            assert len(plans) == 1 and plans[0].blobs == [] and plans[0].nbytes == 0
            return
        assert all(p.blobs for p in plans), "no empty shard"
        assert len(plans) <= shards
        loads = [p.nbytes for p in plans]
        assert max(loads) <= min(loads) + max(sizes)

    def test_deterministic_and_independent_of_input_order(self):
        rng = random.Random(7)
        sizes = [rng.randrange(0, 10_000) for _ in range(50)] + [500] * 10  # ties included
        blobs = _blobs(sizes)
        first = assign_shards(blobs, shards=5, shard_bytes=1)
        assert assign_shards(blobs, shards=5, shard_bytes=1) == first
        shuffled = blobs[:]
        rng.shuffle(shuffled)
        assert assign_shards(shuffled, shards=5, shard_bytes=1) == first

    def test_largest_first_into_the_lightest_shard(self):
        plans = assign_shards(_blobs([10, 70, 30, 40, 20]), shards=2, shard_bytes=1)
        # 70 -> s0; 40 -> s1; 30 -> s1 (40 < 70); 20 -> s0 (70 == 70, lower index); 10 -> s1
        assert [(p.blobs, p.nbytes) for p in plans] == [([1, 4], 90), ([0, 2, 3], 80)]

    def test_fewer_blobs_than_shards_gives_fewer_files(self):
        plans = assign_shards(_blobs([5, 6]), shards=8, shard_bytes=1)
        assert len(plans) == 2

    @pytest.mark.parametrize("shards", [0, -1])
    def test_shard_count_must_be_positive(self, shards):
        with pytest.raises(ValueError, match="shards must be >= 1"):
            plan_save([], shards=shards)


class TestPlanBlobs:
    def test_tied_tensors_share_one_blob(self):
        w = torch.randn(4, 3)
        blobs, refs = plan_blobs(_leaves(a=w, b=w, c=torch.randn(2)))
        assert len(blobs) == 2
        assert refs[0] == refs[1]
        assert refs[0].stride is None
        assert refs[2].blob != refs[0].blob

    def test_overlapping_views_share_a_blob_spanning_only_used_bytes(self):
        buf = torch.arange(100, dtype=torch.float32)
        x, y = buf[10:30], buf[20:50:2]
        blobs, refs = plan_blobs(_leaves(x=x, y=y))
        assert len(blobs) == 1
        assert blobs[0].shape == (39,)  # elements 10..48
        assert blobs[0].nbytes == 39 * 4
        assert torch.equal(blobs[0].source.contiguous(), buf[10:49])
        assert (refs[0].offset, refs[0].stride) == (0, (1,))
        assert (refs[1].offset, refs[1].stride) == (10, (2,))
        for ref, t in zip(refs, (x, y), strict=True):
            rebuilt = torch.as_strided(blobs[0].source.clone(), ref.shape, ref.stride, ref.offset)
            assert torch.equal(rebuilt, t)

    def test_views_of_different_dtypes_are_stored_apart(self):
        f = torch.randn(8)
        blobs, refs = plan_blobs(_leaves(f=f, i=f.view(torch.int32)))
        assert len(blobs) == 2
        assert [b.dtype for b in blobs] == [torch.float32, torch.int32]
        assert all(r.stride is None for r in refs)

    def test_empty_tensors_never_share(self):
        blobs, _ = plan_blobs(_leaves(a=torch.empty(0), b=torch.empty(0, 3)))
        assert [b.shape for b in blobs] == [(0,), (0, 3)]
        assert all(b.nbytes == 0 for b in blobs)

    def test_a_small_slice_of_a_big_tensor_stores_only_its_elements(self):
        big = torch.zeros(1_000_000)
        blobs, _ = plan_blobs(_leaves(s=big[500:503]))
        assert blobs[0].nbytes == 12

    def test_dataset_names_are_flat_and_unique(self):
        taken: set[str] = set()
        assert dataset_name("model/fc.weight", taken) == "model.fc.weight"
        assert dataset_name("model.fc/weight", taken) == "model.fc.weight#2"
        assert dataset_name("", taken) == "root"
        assert dataset_name(".", taken) == "_."
        assert dataset_name("..", taken) == "_.."

    def test_dataset_names_escape_nul(self):
        """Bug fixed: a key holding a NUL made HDF5 fail mid-save (names are C strings)."""
        assert dataset_name("a\x00b/c", set()) == "a\\x00b.c"
        assert dataset_name("\x00", set()) == "\\x00"


def _json_round_trip(structure):
    return json.loads(json.dumps(structure, allow_nan=False))


def _same(a, b) -> bool:
    """Equal values of the same types, floats compared bit for bit (nan equals nan)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (math.copysign(1, a) == math.copysign(1, b) and a == b)
    if isinstance(a, dict):
        return (
            list(a) == list(b)
            and all(type(k1) is type(k2) for k1, k2 in zip(a, b, strict=True))
            and all(_same(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


TRICKY = [
    {},
    [],
    (),
    {"a": ()},
    {"$tensor": 0},  # a user dict that looks like a tag
    {"$dict": [[1, 2]], "x": 1},
    {"$float": "nan"},
    {1: "int key", "1": "str key", None: "none key", 2.5: "float key", (1, "a"): "tuple key"},
    {"b": 1, "a": 2, "c": 3},  # key order kept
    {"b": 1, 0: 2, "a": 3},
    (1, (2, (3, [4, (5,)]))),
    [True, 1, 1.0, False, 0, 0.0, -0.0],
    [math.inf, -math.inf, math.nan],
    [2**100, -(2**80), 0],
    [b"", b"\x00\xff\x00", bytearray(b"ab")],
    ["", "ünïcödé ☃", "with/slash", "$leading"],
    [torch.float32, torch.bfloat16, torch.int64],
    None,
    "scalar",
    {"lr_lambdas": [None], "base_lrs": [0.1], "_last_lr": [0.1], "verbose": False},
]


class TestStructure:
    @pytest.mark.parametrize("value", TRICKY, ids=lambda v: repr(v)[:40])
    def test_encode_decode_is_identity_through_json(self, value):
        structure, leaves = encode(value)
        assert leaves == []
        back = decode(_json_round_trip(structure), lambda i, n: pytest.fail("no leaves"))
        expected = bytes(value) if isinstance(value, bytearray) else value
        if isinstance(value, list):
            expected = [bytes(v) if isinstance(v, bytearray) else v for v in value]
        assert _same(back, expected), (value, back)

    def test_numpy_scalars_become_python_scalars(self):
        structure, _ = encode({"i": np.int64(3), "f": np.float32(0.5), "b": np.bool_(True)})
        back = decode(_json_round_trip(structure), lambda i, n: None)
        assert _same(back, {"i": 3, "f": 0.5, "b": True})

    def test_leaves_are_referenced_in_order_with_their_paths(self):
        t, a = torch.ones(2), np.zeros(3, dtype=np.int16)
        state = {"m": {"w": t, 3: [a, (t,)]}}
        structure, leaves = encode(state)
        assert [(lf.path, lf.is_numpy) for lf in leaves] == [
            ("m/w", False),
            ("m/3/0", True),
            ("m/3/1/0", False),
        ]
        assert sorted(leaf_refs(structure)) == [0, 1, 2]
        back = decode(_json_round_trip(structure), lambda i, n: ("leaf", i, n))
        assert back == {"m": {"w": ("leaf", 0, False), 3: [("leaf", 1, True), (("leaf", 2, False),)]}}

    def test_shared_subtrees_are_allowed_but_cycles_are_refused(self):
        shared = [1, 2]
        structure, _ = encode({"a": shared, "b": shared})
        assert decode(structure, lambda i, n: None) == {"a": [1, 2], "b": [1, 2]}
        cyclic: dict = {"x": []}
        cyclic["x"].append(cyclic)
        with pytest.raises(UnsupportedValueError, match=r"x/0.*cycle"):
            encode(cyclic)

    @settings(max_examples=200, deadline=None)
    @given(
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats()
            | st.text(max_size=8)
            | st.binary(max_size=8),
            lambda kids: (
                st.lists(kids, max_size=4)
                | st.lists(kids, max_size=4).map(tuple)
                | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), kids, max_size=4)
            ),
            max_leaves=20,
        )
    )
    def test_any_plain_structure_round_trips(self, value):
        structure, _ = encode(value)
        assert _same(decode(_json_round_trip(structure), lambda i, n: None), value)


def _state_structure():
    state = {
        "model": {"w": torch.ones(2), "b": torch.zeros(1)},
        "optimizer": {
            "state": {
                0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(2)},
                1: {"step": torch.tensor(2.0)},
            },
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}],
        },
        "layers": [{"w": torch.ones(1)}, {"w": torch.ones(3)}],
        "epoch": 3,
    }
    return state, encode(state)


class TestSelect:
    def _decode(self, selected, leaves):
        return decode(selected, lambda i, n: leaves[i].path)

    def test_top_level_key(self):
        _, (structure, leaves) = _state_structure()
        assert self._decode(select(structure, ["model"]), leaves) == {
            "model": {"w": "model/w", "b": "model/b"}
        }

    def test_nested_key_paths_keep_the_dicts_leading_to_them(self):
        _, (structure, leaves) = _state_structure()
        out = self._decode(select(structure, ["optimizer/param_groups", "model/w", "epoch"]), leaves)
        assert out == {
            "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]},
            "model": {"w": "model/w"},
            "epoch": 3,
        }

    def test_sibling_paths_merge(self):
        _, (structure, leaves) = _state_structure()
        out = self._decode(select(structure, ["model/w", "model/b"]), leaves)
        assert out == {"model": {"w": "model/w", "b": "model/b"}}

    def test_through_int_keyed_dicts_and_lists(self):
        _, (structure, leaves) = _state_structure()
        out = self._decode(select(structure, ["optimizer/state", "layers/1/w"]), leaves)
        assert out["optimizer"]["state"] == {
            0: {"step": "optimizer/state/0/step", "exp_avg": "optimizer/state/0/exp_avg"},
            1: {"step": "optimizer/state/1/step"},
        }
        assert list(out["optimizer"]["state"]) == [0, 1]  # int keys stay ints
        assert out["layers"] == {"1": {"w": "layers/1/w"}}

    def test_int_keys_stay_ints_below_the_selected_path(self):
        """Bug fixed: selecting ``optimizer/state/1/...`` returned the state keyed by the string "1"."""
        _, (structure, leaves) = _state_structure()
        out = self._decode(select(structure, ["optimizer/state/1/step", "optimizer/state/0/exp_avg"]), leaves)
        assert out == {
            "optimizer": {
                "state": {1: {"step": "optimizer/state/1/step"}, 0: {"exp_avg": "optimizer/state/0/exp_avg"}}
            }
        }
        assert [type(k) for k in out["optimizer"]["state"]] == [int, int]

    def test_paths_into_tuples(self):
        structure, leaves = encode({"pair": (torch.ones(1), {"x": torch.zeros(1)})})
        assert self._decode(select(structure, ["pair/1/x"]), leaves) == {"pair": {"1": {"x": "pair/1/x"}}}

    def test_a_path_below_an_already_selected_subtree_changes_nothing(self):
        _, (structure, leaves) = _state_structure()
        before = json.dumps(structure, sort_keys=True)
        both = self._decode(select(structure, ["optimizer/state", "optimizer/state/0/step"]), leaves)
        assert both == self._decode(select(structure, ["optimizer/state"]), leaves)
        assert json.dumps(structure, sort_keys=True) == before

    def test_selects_only_the_leaves_under_the_keys(self):
        _, (structure, leaves) = _state_structure()
        refs = sorted(leaf_refs(select(structure, ["model"])))
        assert [leaves[i].path for i in refs] == ["model/w", "model/b"]

    def test_surrounding_slashes_are_ignored(self):
        _, (structure, leaves) = _state_structure()
        assert self._decode(select(structure, ["/model/w/"]), leaves) == {"model": {"w": "model/w"}}

    @pytest.mark.parametrize(
        ("key", "missing"),
        [
            ("nope", "nope"),
            ("model/nope", "nope"),
            ("layers/5", "5"),
            ("epoch/x", "x"),
            ("optimizer/state/7", "7"),
        ],
    )
    def test_missing_key_is_named(self, key, missing):
        _, (structure, _) = _state_structure()
        with pytest.raises(KeyError, match=f"no key '{key}'.*missing part: '{missing}'"):
            select(structure, [key])


class TestShardsOverRanks:
    """``shards`` is the number of files of a version at every world size (one per rank at least)."""

    @pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
    @pytest.mark.parametrize("shards", [1, 2, 3, 4, 7, 16])
    def test_every_world_size_writes_the_files_asked(self, shards, world):
        counts = shards_per_rank(shards, world)
        assert len(counts) == world and sum(counts) == max(shards, world)
        assert max(counts) - min(counts) <= 1 and min(counts) >= 1

    @pytest.mark.parametrize("world", [1, 2, 3])
    def test_the_ranks_files_hold_every_blob_once(self, world):
        blobs = _blobs([100 + 7 * i for i in range(40)])
        plans = [
            assign_rank_shards(blobs, shards=4, world_size=world, rank=r, shard_bytes=1) for r in range(world)
        ]
        assert sum(len(p) for p in plans) == 4
        held = sorted(i for p in plans for shard in p for i in shard.blobs)
        assert held == list(range(len(blobs)))
