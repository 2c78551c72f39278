"""Lineage in the manifest: each version's parent (the version its state was loaded from, or the
store's previous save), what the caller adds (run, spec, config hash, code), refused before any
I/O when a manifest could not hold it; manifests without one (saved before format 7) still load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptflow.storage import CheckpointStore, Lineage, StoreOptions, UnsupportedValueError
from ckptflow.storage.format.manifest import FORMAT_VERSION, LINEAGE_FORMAT_VERSION


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def raw_manifest(store: CheckpointStore, version: int) -> dict:
    return json.loads((Path(store.url) / f"v{version:06d}" / "manifest.json").read_bytes())


def test_each_save_names_the_one_before_and_a_load_names_what_it_read(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store")
    for epoch in (1, 2, 3):
        store.save(state(epoch), epoch=epoch)
    resumed = CheckpointStore(tmp_path / "store")  # a new process, as after a crash
    resumed.load(2)
    fork = resumed.save(state(9))
    handle = resumed.save_async(state(10))
    handle.wait()
    after_async = resumed.save(state(11))
    parents = [(v.version, v.parent) for v in CheckpointStore(tmp_path / "store").versions()]
    assert (fork.version, handle.version, after_async.version) == (4, 5, 6)
    assert parents == [(1, None), (2, 1), (3, 2), (4, 2), (5, 4), (6, 5)]


def test_a_new_store_object_that_loaded_nothing_starts_anew(tmp_path: Path) -> None:
    CheckpointStore(tmp_path / "store").save(state(1), epoch=1)
    again = CheckpointStore(tmp_path / "store").save(state(2), epoch=2)
    assert again.parent is None and again.lineage == {}


def test_what_the_caller_gives_is_kept_and_the_format_says_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", options=StoreOptions(dedup=False))  # no content keys
    plain = store.save(state(1))
    given = {"run": "r-1", "spec": "m:Spec", "config_hash": "abc", "code": {"git": "0" * 40}}
    info = store.save(state(2), lineage=given)
    assert info.lineage == {**given, "parent": plain.version}
    assert store.versions()[-1].lineage == info.lineage
    assert raw_manifest(store, info.version)["format_version"] == LINEAGE_FORMAT_VERSION == FORMAT_VERSION - 1
    assert "lineage" not in raw_manifest(store, plain.version), "no lineage, no format 7"
    assert raw_manifest(store, plain.version)["format_version"] == 6  # older ckptflow still reads it
    explicit = store.save(state(3), lineage={"parent": plain.version})
    assert explicit.parent == plain.version, "an explicit parent wins over the store's last save"
    typed = store.save(state(4), lineage=Lineage(spec="m:Spec"))  # the type, as the pipeline gives it
    assert typed.lineage == {"spec": "m:Spec", "parent": explicit.version}
    orphan = store.save_async(state(5), lineage=Lineage(parent=None)).wait()  # None given: no parent
    assert orphan.parent is None


@pytest.mark.parametrize(
    "lineage, problem",
    [({"parent": -1}, "greater than or equal to 0"), ({"father": 1}, "father"), ({"code": "abc"}, "code")],
)
def test_a_lineage_a_manifest_cannot_hold_is_refused_before_anything_is_written(
    tmp_path: Path, lineage: dict, problem: str
) -> None:
    store = CheckpointStore(tmp_path / "store")
    with pytest.raises(UnsupportedValueError, match=problem):
        store.save(state(1), lineage=lineage)
    root = tmp_path / "store"
    assert not root.exists() or not any(p.name.startswith("v") for p in root.iterdir())
