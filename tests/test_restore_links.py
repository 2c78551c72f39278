"""``ckptflow restore`` and its writers never write through a symbolic link at the output path.

A link at ``--out`` (to a file, a directory or nowhere) is refused by the command, in every format
(torch, safetensors, the sharded directory); the writers themselves (:mod:`ckptflow.flows.export`)
replace a link at their path and leave what it points to as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.flows.export import write_hf_shards, write_state
from ckptflow.storage import CheckpointStore
from tests.conftest import assert_same_state

FORMATS = {
    "torch": [],
    "safetensors": ["--format", "safetensors"],
    "shards": ["--format", "safetensors", "--max-shard-size", "1KB"],
}


def state() -> dict[str, torch.Tensor]:
    return {"b": torch.ones(3), "w": torch.arange(600, dtype=torch.float32)}  # safetensors sorts its keys


def linked(tmp_path: Path, *, dangling: bool, directory: bool = False) -> tuple[Path, Path]:
    """A link ``out/model`` to ``elsewhere/precious`` (a file or a directory, or nothing there)."""
    target = tmp_path / "elsewhere" / "precious"
    target.parent.mkdir()
    if not dangling and directory:
        target.mkdir()
        (target / "mine.txt").write_bytes(b"mine")
    elif not dangling:
        target.write_bytes(b"precious")
    link = tmp_path / "out" / "model"
    link.parent.mkdir()
    link.symlink_to(target)
    return link, target


def untouched(target: Path, *, dangling: bool, directory: bool = False) -> None:
    if dangling:
        assert os.listdir(target.parent) == [], "a file was written through the link"
    elif directory:
        assert os.listdir(target) == ["mine.txt"] and (target / "mine.txt").read_bytes() == b"mine"
    else:
        assert target.read_bytes() == b"precious"


@pytest.mark.parametrize("dangling", [True, False], ids=["dangling", "to-a-file"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_restore_refuses_a_symlinked_out_in_every_format(tmp_path: Path, fmt: str, dangling: bool) -> None:
    """Bug fix: ``restore -o LINK`` (torch, safetensors or --max-shard-size) wrote at the link's
    target and exited 0; a dangling link needed no --force since nothing "existed" at OUT."""
    url = str(tmp_path / "store")
    CheckpointStore(url).save(state(), epoch=0)
    link, target = linked(tmp_path, dangling=dangling)
    result = CliRunner().invoke(app, ["restore", url, "-o", str(link), *FORMATS[fmt], "--force"])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"error: {link} is a symbolic link (to {target}): restore writes no file")
    assert link.is_symlink()
    untouched(target, dangling=dangling)


@pytest.mark.parametrize("dangling", [True, False], ids=["dangling", "to-a-file"])
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_the_file_writer_replaces_a_link_and_never_writes_through_it(
    tmp_path: Path, fmt: str, dangling: bool
) -> None:
    """Bug fix: write_state resolved its path, so it wrote (and chmod-ed) the file a link named."""
    link, target = linked(tmp_path, dangling=dangling)
    assert write_state(state(), link, fmt=fmt) == 2  # type: ignore[arg-type]
    assert not link.is_symlink() and link.is_file()
    got = torch.load(link, weights_only=True) if fmt == "torch" else load_file(link)
    assert_same_state(got, state())
    untouched(target, dangling=dangling)
    assert sorted(os.listdir(link.parent)) == ["model"]


@pytest.mark.parametrize("dangling", [True, False], ids=["dangling", "to-a-directory"])
def test_the_shard_writer_replaces_a_link_and_never_writes_through_it(tmp_path: Path, dangling: bool) -> None:
    """Bug fix: write_hf_shards resolved its path, so it replaced the directory a link named."""
    link, target = linked(tmp_path, dangling=dangling, directory=True)
    tensors, files = write_hf_shards(state(), link, max_shard_size="1KB")
    assert tensors == 2 and not link.is_symlink() and link.is_dir()
    assert sorted(os.listdir(link)) == files and "model.safetensors.index.json" in files
    untouched(target, dangling=dangling, directory=True)
    assert sorted(os.listdir(link.parent)) == ["model"]
