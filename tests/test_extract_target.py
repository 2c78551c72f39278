"""Where ``ckptflow extract`` (and :func:`extract_epoch`) may write: a new or empty real directory.

Bug fixed (issue 35): ``ckptflow extract TAR --epoch 2 --out STORE`` into an existing store
replaced its committed version 2 with the tarball's and exited 0; it also followed a
symlinked ``--out`` and merged into a directory that held other files. Now the target must
be missing or an empty directory that is not a symbolic link; anything else is refused
(exit 1, one ``error:`` line naming the directory and saying to choose a new one) and
nothing there changes.

Real stores in temp directories, the CLI through typer's CliRunner and as a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.storage import CheckpointError, CheckpointStore, extract_epoch
from ckptflow.storage.archive.extract import extract_version
from ckptflow.storage.files.location import open_location
from tests.conftest import assert_same_state

TAR = "epochs-000001-000003.tar"


def make_state(tag: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(tag)), "b": torch.arange(8.0) + tag, "step": tag}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: file bytes, link targets (what must not change)."""
    found: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            found[rel] = f"-> {os.readlink(p)}"
        elif p.is_file():
            found[rel] = p.read_bytes()
    return found


@pytest.fixture
def tarball(tmp_path: Path) -> Path:
    """``archive/epochs-000001-000003.tar`` of a store holding versions 1-3 (epochs 1-3)."""
    root = tmp_path / "source"
    with CheckpointStore(str(root)) as s:
        for epoch in (1, 2, 3):
            s.save(make_state(epoch), epoch=epoch, version=epoch)
        s.archive([1, 2, 3])
    return root / "archive" / TAR


@pytest.fixture
def other_store(tmp_path: Path) -> Path:
    """Another run's store, whose committed version 2 holds other bytes."""
    root = tmp_path / "other"
    with CheckpointStore(str(root)) as s:
        s.save(make_state(100), epoch=7, version=1)
        s.save(make_state(200), epoch=8, version=2)
    return root


class TestExistingTargets:
    def test_extract_into_an_existing_store_is_refused_and_its_version_kept(self, tarball, other_store):
        """Bug: extract into an existing store replaced its committed version 2 and exited 0."""
        before = snapshot(other_store)
        result = invoke("extract", str(tarball), "--epoch", "2", "--out", str(other_store))
        assert result.exit_code == 1, result.output
        assert result.stderr.splitlines() == [
            f"error: {other_store} is not empty (it holds latest, v000001, v000002): extract writes only "
            "into a new or empty directory, so that it never replaces or mixes with files there; choose a "
            "new directory"
        ]
        assert snapshot(other_store) == before
        store = CheckpointStore(str(other_store))
        assert [v.version for v in store.versions()] == [1, 2]
        assert_same_state(store.load(2), make_state(200))

    def test_the_library_entry_point_refuses_it_too(self, tarball, other_store):
        before = snapshot(other_store)
        with pytest.raises(CheckpointError, match=rf"{other_store} is not empty .*choose a new directory"):
            extract_epoch(str(tarball), str(other_store), epoch=2)
        assert snapshot(other_store) == before

    def test_a_directory_with_other_files_is_not_merged_into(self, tarball, tmp_path):
        """Bug: extract merged the version into a directory that held other files."""
        out = tmp_path / "notes"
        out.mkdir()
        (out / "readme.txt").write_text("mine")
        proc = subprocess.run(
            [sys.executable, "-m", "ckptflow.flows.cli", "extract", str(tarball), "-e", "2", "-o", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.startswith(f"error: {out} is not empty (it holds readme.txt)")
        assert "Traceback" not in proc.stderr
        assert snapshot(out) == {"readme.txt": b"mine"}

    def test_a_file_is_refused(self, tarball, tmp_path):
        out = tmp_path / "file"
        out.write_text("x")
        result = invoke("extract", str(tarball), "--epoch", "2", "--out", str(out))
        assert result.exit_code == 1
        assert result.stderr.startswith(f"error: {out} is a file, not a directory")
        assert result.stderr.rstrip().endswith("choose a new directory")
        assert out.read_text() == "x"

    def test_an_existing_version_directory_is_never_replaced_by_extract_version(self, tarball, other_store):
        """The lower-level call (several versions into one directory) keeps an existing version."""
        before = snapshot(other_store)
        with pytest.raises(CheckpointError, match=rf"{other_store}/v000002 exists: .*choose a new directory"):
            extract_version(
                open_location(str(tarball.parent)), TAR, str(other_store), version_prefix="v000002/"
            )
        assert snapshot(other_store) == before


class TestSymlinkedTargets:
    @pytest.mark.parametrize("kind", ["to-an-empty-directory", "dangling"])
    def test_a_symlinked_target_is_refused(self, tarball, tmp_path, kind):
        """Bug: extract followed a symlinked --out and wrote where it pointed."""
        elsewhere = tmp_path / "elsewhere"
        if kind == "to-an-empty-directory":
            elsewhere.mkdir()
        out = tmp_path / "link"
        out.symlink_to(elsewhere)
        result = invoke("extract", str(tarball), "--epoch", "2", "--out", str(out))
        assert result.exit_code == 1, result.output
        assert result.stderr.splitlines() == [
            f"error: {out} is a symbolic link (to {elsewhere}): extract writes only into a real directory; "
            "choose a new directory"
        ]
        assert out.is_symlink() and os.readlink(out) == str(elsewhere)
        assert (list(elsewhere.iterdir()) == []) if kind != "dangling" else not elsewhere.exists()
        with pytest.raises(CheckpointError, match="is a symbolic link"):
            extract_epoch(str(tarball), str(out), epoch=2)


class TestGoodTargets:
    @pytest.mark.parametrize("kind", ["new", "new-with-parents", "empty"])
    def test_a_new_or_empty_directory_opens_as_a_store(self, tarball, tmp_path, kind):
        out = tmp_path / "out" / "deeper" if kind == "new-with-parents" else tmp_path / "out"
        if kind == "empty":
            out.mkdir()
        result = invoke("extract", str(tarball), "--epoch", "2", "--out", str(out))
        assert result.exit_code == 0, result.output
        assert os.listdir(out) == ["v000002"]
        assert_same_state(CheckpointStore(str(out)).load(2), make_state(2))

    def test_a_failed_extraction_removes_the_directory_it_created(self, tarball, tmp_path):
        out = tmp_path / "new"
        result = invoke("extract", str(tarball), "--epoch", "9", "--out", str(out))
        assert result.exit_code == 1
        assert "holds no epoch 9" in result.stderr
        assert not out.exists()
        # and the same directory then takes the extraction
        assert invoke("extract", str(tarball), "--epoch", "3", "--out", str(out)).exit_code == 0
        assert json.loads(invoke("ls", str(out), "--json").stdout)["versions"][0]["version"] == 3
