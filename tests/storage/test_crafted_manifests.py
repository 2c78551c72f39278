"""A crafted or damaged manifest is refused, named, and takes no other version down.

The crafted manifests are sealed again (their ``manifest_checksum`` recomputed), as a deliberate
crafter would: what is tested is the full check below the seal. The seal itself is tested in
:class:`TestEditsAfterWriting`.

Before the full check (storage/manifest_checks.py), a shard name such as
``../../../../etc/passwd`` made ``load`` return that file's bytes and ``verify`` say ok;
huge or negative shapes, unknown dtypes, dangling references and a negative offset
raised raw RuntimeError/ValueError/IndexError/OSError (or were accepted silently); and a
100,000-deep structure crashed ``ls``, ``show`` and ``verify`` with RecursionError.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptflow.storage import (
    CheckpointStore,
    CorruptShardError,
    ManifestError,
    StoreOptions,
    VersionNotFoundError,
)
from ckptflow.storage.format.manifest import SEAL_KEY, seal
from tests.test_cli import invoke

Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Edit:
    """An edit that sets ``a.b.0.c`` in the manifest to ``value``."""

    def edit(m: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = m
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def _deep(levels: int) -> Edit:
    def edit(m: dict[str, Any]) -> None:
        text = "[" * levels + "]" * levels
        m["structure"] = {"w": {"$tensor": 0}, "deep": json.loads(text) if levels < 500 else None}
        if levels >= 500:
            m["structure"]["deep"] = "@DEEP@"

    return edit


def _bfloat16_ndarray(m: dict[str, Any]) -> None:
    """The 16-byte tensor ``w`` as 8 bfloat16s, marked a numpy array (numpy has no bfloat16)."""
    m["blobs"][0].update(dtype="bfloat16", shape=[8])
    m["tensors"][0].update(dtype="bfloat16", shape=[8], stride=[1])
    m["structure"]["w"] = {"$ndarray": 0}


CRAFTED: dict[str, tuple[Edit, str]] = {
    "shard outside the store": (_set("shards.0.file", "../../../../../etc/passwd"), "shards[0].file"),
    "absolute shard path": (_set("shards.0.file", "/etc/passwd"), "shards[0].file"),
    "shard with a scheme": (_set("shards.0.file", "s3://bucket/x.h5"), "shards[0].file"),
    "backslash shard path": (_set("shards.0.file", "..\\..\\x.h5"), "shards[0].file"),
    "hidden shard name": (_set("shards.0.file", ".manifest.json"), "shards[0].file"),
    "shard name ending in a newline": (_set("shards.0.file", "shard-r0-00.h5\n"), "shards[0].file"),
    "look-alike dots in a shard name": (_set("shards.0.file", "\uff0e\uff0e"), "shards[0].file"),
    "shard checksum not hex": (_set("shards.0.checksum", "zz"), "shards[0].checksum"),
    "huge shape": (_set("blobs.0.shape", [1 << 40]), "blobs[0].nbytes"),
    "negative shape": (_set("blobs.0.shape", [-4]), "blobs[0].shape"),
    "negative offset": (_set("blobs.0.offset", -8), "blobs[0].offset"),
    "offset past the shard": (_set("blobs.0.offset", 1 << 30), "blobs[0].offset"),
    "unknown blob dtype": (_set("blobs.0.dtype", "float128"), "blobs[0].dtype"),
    "blob in no shard": (_set("blobs.0.shard", 7), "blobs[0].shard"),
    "tensor of no blob": (_set("tensors.0.blob", 99), "tensors[0].blob"),
    "stride past the blob": (_set("tensors.0.stride", [1000]), "tensors[0]"),
    "tensor offset past the blob": (_set("tensors.0.offset", 100), "tensors[0]"),
    "negative tensor offset": (_set("tensors.0.offset", -1), "tensors[0].offset"),
    "tensor dtype of another width": (_set("tensors.0.dtype", "float64"), "tensors[0].dtype"),
    "reference to no tensor": (_set("structure.w", {"$tensor": 99}), "structure"),
    "bytes not base64": (_set("structure.b", {"$bytes": "@@not base64@@"}), "structure"),
    "unknown tag": (_set("structure.x", {"$evil": 1}), "structure"),
    "float tag not a float": (_set("structure.x", {"$float": "1e999"}), "structure"),
    "unknown dtype value": (_set("structure.x", {"$dtype": "float128"}), "structure"),
    "structure deeper than allowed": (_deep(70), "structure"),
    "user data nested too deeply": (_set("user", json.loads("[" * 200 + "]" * 200)), "nested 200 levels"),
    "shape past any real size": (_set("blobs.0.shape", [0, 10**30]), "blobs[0].shape"),
    "empty view far past its blob": (_set("tensors.0.offset", 10**30), "tensors[0].offset"),
    "stride past any real size": (_set("tensors.0.stride", [10**30]), "tensors[0].stride"),
    "unhashable dict key": (_set("structure.x", {"$dict": [[[[1]], 2]]}), "$dict key"),
    "dict key that is an object": (_set("structure.x", {"$dict": [[{"a": 1}, 2]]}), "$dict key"),
    "ndarray of a dtype numpy lacks": (_bfloat16_ndarray, "numpy cannot hold"),
}


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    """Versions 1 (intact) and 2 (the one the tests craft); a 4-element float32 tensor each."""
    s = CheckpointStore(tmp_path / "store", options=StoreOptions(shards=1))
    s.save({"w": torch.arange(4, dtype=torch.float32), "b": b"xy"}, epoch=1)
    s.save({"w": torch.arange(4, dtype=torch.float32) + 1, "b": b"xy"}, epoch=2)
    return s


def _craft(store: CheckpointStore, edit: Edit) -> Path:
    path = Path(store.loc.root) / "v000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    text = json.dumps(seal(manifest, SEAL_KEY))  # sealed again, as a deliberate crafter would
    if "@DEEP@" in text:  # deeper than Python's JSON decoder recurses
        text = text.replace('"@DEEP@"', "[" * 100_000 + "]" * 100_000)
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_manifest_is_refused_and_named(store: CheckpointStore, case: str) -> None:
    edit, field = CRAFTED[case]
    _craft(store, edit)
    with pytest.raises(ManifestError) as caught:
        store.load(2)
    message = str(caught.value)
    assert "v000002/manifest.json" in message and field in message, message
    assert [v.version for v in store.versions()] == [1]  # listed as unreadable, the other stays
    assert torch.equal(store.load(1)["w"], torch.arange(4, dtype=torch.float32))
    assert store.latest().version == 1


@pytest.mark.parametrize("case", ["shard outside the store", "huge shape", "unknown tag"])
def test_commands_report_it_in_one_line(store: CheckpointStore, case: str) -> None:
    _craft(store, CRAFTED[case][0])
    url = store.loc.root
    listing = invoke("ls", url, "--json")
    assert listing.exit_code == 0
    document = json.loads(listing.stdout)
    assert [v["version"] for v in document["versions"]] == [1]
    assert [u["version"] for u in document["unreadable"]] == [2]
    for args in (["verify", url], ["verify", url, "--all"], ["show", url, "--version", "2"]):
        result = invoke(*args)
        assert result.exit_code == 1, args
        assert "Traceback" not in result.output
        assert any("v000002/manifest.json" in line for line in result.stderr.splitlines()), result.stderr


def test_a_100000_deep_structure_does_not_crash_listing(store: CheckpointStore) -> None:
    _craft(store, _deep(100_000))
    result = invoke("ls", store.loc.root, "--json")
    assert result.exit_code == 0, result.output
    [bad] = json.loads(result.stdout)["unreadable"]
    assert bad["version"] == 2 and "nested too deeply" in bad["error"]


def test_a_shard_name_outside_the_store_never_reads_the_file(store: CheckpointStore, tmp_path: Path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 16)
    path = _craft(store, lambda m: None)
    manifest = json.loads(path.read_text())
    from ckptflow.storage.format.checksum import digest

    manifest["shards"][0].update(file="../../secret.bin", size=16, checksum=digest(b"s" * 16))
    path.write_text(json.dumps(seal(manifest, SEAL_KEY)))
    with pytest.raises(ManifestError, match=r"shards\[0\]\.file"):
        store.verify(2)
    with pytest.raises(ManifestError):
        store.load(2)


class TestVerifyChecksWhatLoadChecks:
    """verify used to check only the shard-level checksum: a wrong blob checksum passed verify and
    failed load."""

    def test_a_wrong_blob_checksum_fails_verify(self, store: CheckpointStore) -> None:
        _craft(store, _set("blobs.0.checksum", "0123456789abcdef"))
        with pytest.raises(CorruptShardError, match="dataset") as caught:
            store.verify(2)
        assert "v000002/shard-" in str(caught.value)
        with pytest.raises(CorruptShardError):
            store.load(2)
        assert store.verify(1).version == 1

    def test_blobs_across_chunks_verify_and_a_flipped_byte_fails(self, tmp_path: Path) -> None:
        s = CheckpointStore(tmp_path / "big", options=StoreOptions(shards=1))
        state = {"a": torch.zeros(3), "big": torch.arange(3 << 20, dtype=torch.float32), "z": torch.ones(5)}
        info = s.save(state, epoch=1)
        assert s.verify(1) == info  # 12 MiB: more than one read chunk
        manifest = s.manifest(1)
        [big] = [b for b in manifest.blobs if b.nbytes == 12 << 20]
        shard = Path(s.loc.root) / "v000001" / manifest.shards[big.shard].file
        data = bytearray(shard.read_bytes())
        data[big.offset + (9 << 20)] ^= 0xFF  # in the second chunk of the big blob
        shard.write_bytes(bytes(data))
        with pytest.raises(CorruptShardError, match=f"v000001/{shard.name}"):
            s.verify(1)


class TestEditsAfterWriting:
    """Edits that keep valid JSON (a hyperparameter, a shape, two tensor paths swapped) used to load
    wrong data silently and pass verify: the manifest's own checksum now catches them."""

    @pytest.mark.parametrize(
        "edit",
        [
            _set("structure.b", {"$bytes": "eHo="}),  # b"xz" for b"xy": a value kept in the structure
            _set("tensors.0.shape", [2, 2]),
            _set("metrics", {"val_loss": 0.1}),
        ],
        ids=["value", "shape", "metric"],
    )
    def test_an_unsealed_edit_is_refused(self, store: CheckpointStore, edit: Edit) -> None:
        path = Path(store.loc.root) / "v000002" / "manifest.json"
        manifest = json.loads(path.read_text())
        edit(manifest)
        path.write_text(json.dumps(manifest, indent=1))
        with pytest.raises(ManifestError, match="was changed after it was written"):
            store.load(2)
        with pytest.raises(ManifestError, match="was changed after it was written"):
            store.verify(2)
        assert [v.version for v in store.versions()] == [1]

    def test_swapped_tensor_paths_are_refused(self, tmp_path: Path) -> None:
        s = CheckpointStore(tmp_path / "s", options=StoreOptions(shards=1))
        s.save({"a": torch.zeros(4), "b": torch.ones(4)}, epoch=1)
        path = tmp_path / "s" / "v000001" / "manifest.json"
        manifest = json.loads(path.read_text())
        first, second = manifest["tensors"][0]["path"], manifest["tensors"][1]["path"]
        manifest["tensors"][0]["path"], manifest["tensors"][1]["path"] = second, first
        path.write_text(json.dumps(manifest))
        with pytest.raises(ManifestError, match="was changed after it was written"):
            s.load(1)

    def test_removing_the_seal_is_refused(self, store: CheckpointStore) -> None:
        path = Path(store.loc.root) / "v000002" / "manifest.json"
        manifest = json.loads(path.read_text())
        del manifest[SEAL_KEY]
        path.write_text(json.dumps(manifest))
        with pytest.raises(ManifestError, match=f"has no {SEAL_KEY}"):
            store.load(2)

    def test_an_edited_manifest_inside_an_index_is_refused(self, store: CheckpointStore) -> None:
        store.archive([1, 2])
        store.drop_loose([1, 2])
        [index] = (Path(store.loc.root) / "archive").glob("*.index.json")
        raw = json.loads(index.read_text())
        raw["extra"]["manifests"]["2"]["metrics"] = {"val_loss": 0.0}
        index.write_text(json.dumps(raw))
        assert [v.version for v in store.versions()] == []
        with pytest.raises(VersionNotFoundError, match="cannot be read"):
            store.load(2)
