"""The commands and the upkeep work on sharded versions as on any other."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ckptflow.storage import CheckpointStore
from tests.sharded.conftest import Saved, digest
from tests.test_cli import invoke


def test_show_lists_the_chunked_tensors(saved_by_store: Saved) -> None:
    result = invoke("show", saved_by_store.url)
    assert result.exit_code == 0, result.output
    assert "model/blocks.0.up.weight" in result.output and "in 2 chunks" in result.output
    assert "saved by 2 ranks" in result.output


def test_verify_all_and_restore_to_torch_and_safetensors(saved_by_store: Saved, tmp_path: Path) -> None:
    result = invoke("verify", saved_by_store.url, "--all")
    assert result.exit_code == 0 and "ok version 1" in result.output, result.output
    out = tmp_path / "model.pt"
    result = invoke("restore", saved_by_store.url, "--out", str(out), "--format", "torch")
    assert result.exit_code == 0, result.output
    restored = torch.load(out, weights_only=True)
    assert digest(restored) == saved_by_store.full
    flat = tmp_path / "model.safetensors"
    result = invoke(
        "restore", saved_by_store.url, "--out", str(flat), "--format", "safetensors", "--keys", "model"
    )
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    tensors = load_file(flat)
    assert digest(tensors["embed.weight"]) == saved_by_store.full["model"]["embed.weight"]  # one subtree


def test_an_archived_sharded_version_loads_from_its_tarball(saved_by_store: Saved, tmp_path: Path) -> None:
    target = tmp_path / "store"
    shutil.copytree(saved_by_store.url, target)
    store = CheckpointStore(target)
    store.archive([saved_by_store.version])
    store.drop_loose([saved_by_store.version])
    assert not (target / f"v{saved_by_store.version:06d}").exists()
    assert digest(store.load()) == saved_by_store.full
    store.verify(saved_by_store.version)
