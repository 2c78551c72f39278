"""``ckptflow archive`` and ``ckptflow extract`` against real stores, GNU tar and a SeaweedFS S3 server.

What is asserted is what a user sees and gets: exit codes (0; 1 with one ``error:`` line;
2 for usage), the versions ``ckptflow ls`` lists and where it says they live, and the
bytes the versions load as after archiving or extracting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.storage import CheckpointStore, StoreOptions
from ckptflow.storage.archive.tarballs import list_archived
from ckptflow.storage.archive.tarindex import index_name
from ckptflow.storage.remote.transfer import upload_file
from tests.conftest import S3_SECRET, assert_same_state, named

TAR = "epochs-000001-000003.tar"


def make_state(epoch: int) -> dict[str, Any]:
    torch.manual_seed(epoch)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": epoch * 10}


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command in a process, for exit codes and stderr as a shell sees them."""
    return subprocess.run(
        [sys.executable, "-m", "ckptflow.flows.cli", *args], capture_output=True, text=True, timeout=120
    )


def listed(url: str, *options: str) -> list[dict[str, Any]]:
    result = invoke("ls", url, "--json", *options)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["versions"]


def dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("v"))


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, dict[int, dict[str, Any]]]:
    """Versions 1-4 (epochs 1-4) in a local store; yields (its root, the states saved)."""
    root = tmp_path / "store"
    states = {}
    with CheckpointStore(str(root), options=StoreOptions(shards=2, threads=2)) as s:
        for epoch in range(1, 5):
            states[epoch] = make_state(epoch)
            s.save(states[epoch], epoch=epoch, version=epoch, metrics={"loss": 1.0 / epoch})
    return root, states


@pytest.fixture
def archived(store) -> tuple[Path, dict[int, dict[str, Any]]]:
    """The store after ``ckptflow archive --versions 1-3 --drop-loose``."""
    root, states = store
    result = invoke("archive", str(root), "--versions", "1-3", "--drop-loose")
    assert result.exit_code == 0, result.output
    return root, states


class TestArchive:
    def test_archive_drop_loose_then_ls_shows_them_in_the_tarball(self, store):
        root, states = store
        result = invoke("archive", str(root), "--versions", "1-3", "--drop-loose")
        assert result.exit_code == 0, result.output
        assert f"archived versions 1, 2, 3 into {root}/archive/{TAR}" in result.stdout
        assert "removed the loose copies of versions 1, 2, 3" in result.stdout

        assert dirs(root) == ["v000004"]
        assert sorted(os.listdir(root / "archive")) == [index_name(TAR), TAR]
        versions = listed(str(root))
        assert [v["version"] for v in versions] == [1, 2, 3, 4]
        assert [v["url"] for v in versions] == [
            *(f"{root}/archive/{TAR}[v{v:06d}]" for v in (1, 2, 3)),
            f"{root}/v000004",
        ]
        table = invoke("ls", str(root), env={"COLUMNS": "250"})
        assert table.exit_code == 0 and f"{TAR}[v000002]" in table.stdout

        s = CheckpointStore(str(root))
        assert [v.archived for v in s.versions()] == [True, True, True, False]
        for v in range(1, 5):
            assert_same_state(s.load(v), states[v])

    def test_verify_passes_on_an_archived_version_and_fails_on_a_flipped_byte(self, archived):
        root, _ = archived
        proc = run_cli("verify", str(root), "--version", "2")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("ok ") and f"{TAR}[v000002]" in proc.stdout

        index = list_archived(CheckpointStore(str(root)).loc)[2].index
        member = named([m.name for m in index.members], "v000002/shard-r0-00.h5")
        entry = index.entry(member)
        with open(root / "archive" / TAR, "r+b") as f:
            f.seek(entry.offset + entry.size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        proc = run_cli("verify", str(root), "--version", "2")
        assert proc.returncode == 1
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("error: ") and f"{TAR}[{member}]" in proc.stderr
        assert run_cli("verify", str(root), "--version", "1").returncode == 0  # its neighbour is intact

    def test_verify_all_fails_on_a_flipped_bit_in_a_member_header(self, archived, tmp_path):
        """Issue 34: a flipped bit in a member's tar header made GNU tar refuse the tarball, and
        ``verify --all`` still said ok for its versions; each now fails naming the tarball and member."""
        root, _ = archived
        tar = root / "archive" / TAR
        assert run_cli("verify", str(root), "--all").returncode == 0
        entry = list_archived(CheckpointStore(str(root)).loc)[2].index.entry("v000002/manifest.json")
        data = bytearray(tar.read_bytes())
        data[entry.offset - 512 + 2] ^= 0x01  # in the member's name
        tar.write_bytes(bytes(data))
        listed = subprocess.run(["tar", "-tf", str(tar)], capture_output=True, text=True)
        assert listed.returncode != 0 and "Skipping to next header" in listed.stderr
        proc = run_cli("verify", str(root), "--all")
        assert proc.returncode == 1
        lines = proc.stderr.splitlines()
        assert [line.split(":", 1)[0] for line in lines] == ["error"] * 3, proc.stderr
        for version, line in zip((1, 2, 3), lines, strict=True):
            assert line.startswith(f"error: version {version}: corrupt tarball {tar}: ")
            assert "the header of member v000002/manifest.json" in line and "archive them again" in line
        assert proc.stdout.splitlines() == [line for line in proc.stdout.splitlines() if "v000004" in line]
        assert len(proc.stdout.splitlines()) == 1 and proc.stdout.startswith("ok version 4")

        out = tmp_path / "out"
        proc = run_cli("extract", str(tar), "--epoch", "2", "--out", str(out))
        assert proc.returncode == 1
        assert proc.stderr.splitlines() == [proc.stderr.strip()]
        assert proc.stderr.startswith(
            f"error: corrupt tarball {tar}: the header of member v000002/manifest.json"
        )
        assert not out.exists() or os.listdir(out) == []

    def test_without_drop_loose_both_copies_stay_and_the_loose_one_is_read(self, store):
        root, _ = store
        result = invoke("archive", str(root), "--versions", "2,3")
        assert result.exit_code == 0, result.output
        assert "removed the loose copies" not in result.stdout
        assert dirs(root) == [f"v{v:06d}" for v in range(1, 5)]
        assert sorted(list_archived(CheckpointStore(str(root)).loc)) == [2, 3]
        assert [v["url"] for v in listed(str(root))] == [f"{root}/v{v:06d}" for v in range(1, 5)]

    def test_archiving_an_archived_version_again_exits_1(self, archived):
        root, _ = archived
        proc = run_cli("archive", str(root), "--versions", "3-4")
        assert proc.returncode == 1
        assert proc.stderr.splitlines() == [proc.stderr.strip()]
        assert "version 3 is already archived" in proc.stderr
        assert sorted(os.listdir(root / "archive")) == [index_name(TAR), TAR]

    @pytest.mark.parametrize("versions", ["", "a-b", "1-x"])
    def test_bad_version_lists_are_usage_errors(self, store, versions):
        root, _ = store
        assert invoke("archive", str(root), "--versions", versions).exit_code == 2

    def test_gnu_tar_extracts_a_store_h5py_opens(self, archived, tmp_path):
        root, states = archived
        out = tmp_path / "gnu"
        out.mkdir()
        subprocess.run(["tar", "-xf", str(root / "archive" / TAR), "-C", str(out)], check=True)
        assert dirs(out) == ["v000001", "v000002", "v000003"]
        for shard in sorted(out.glob("v*/shard-*.h5")):
            with h5py.File(shard, "r") as f:
                assert len(f.keys()) > 0
        s = CheckpointStore(str(out))
        for v in (1, 2, 3):
            assert_same_state(s.load(v), states[v])


class TestExtract:
    def test_one_epoch_into_a_directory_that_opens_as_a_store(self, archived, tmp_path):
        root, states = archived
        out = tmp_path / "out"
        result = invoke("extract", str(root / "archive" / TAR), "--epoch", "2", "--out", str(out))
        assert result.exit_code == 0, result.output
        assert "extracted epoch 2 (version 2)" in result.stdout
        assert os.listdir(out) == ["v000002"]
        assert [v["version"] for v in listed(str(out))] == [2]
        assert_same_state(CheckpointStore(str(out)).load(2), states[2])
        assert CheckpointStore(str(out)).verify(2).version == 2

    def test_a_missing_epoch_exits_1_with_one_line(self, archived, tmp_path):
        root, _ = archived
        out = tmp_path / "out"
        proc = run_cli("extract", str(root / "archive" / TAR), "--epoch", "4", "--out", str(out))
        assert proc.returncode == 1
        assert proc.stderr.splitlines() == [f"error: {TAR} holds no epoch 4 (epochs: 1, 2, 3)"]
        assert not out.exists() or os.listdir(out) == []

    @pytest.mark.s3
    def test_from_a_tarball_on_s3(self, archived, s3_bucket, tmp_path):
        root, states = archived
        bucket, options = s3_bucket
        for name in (TAR, index_name(TAR)):
            upload_file(root / "archive" / name, f"s3://{bucket}/run/archive/{name}", storage_options=options)
        out = tmp_path / "out"
        result = invoke(
            "extract",
            f"s3://{bucket}/run/archive/{TAR}",
            "--epoch",
            "3",
            "--out",
            str(out),
            "--storage-options",
            json.dumps(options),
        )
        assert result.exit_code == 0, result.output
        assert S3_SECRET not in result.output
        assert [v["version"] for v in listed(str(out))] == [3]
        assert_same_state(CheckpointStore(str(out)).load(3), states[3])
        # The remote tarball is a store's archive too: ls lists it there.
        remote = listed(f"s3://{bucket}/run", "--storage-options", json.dumps(options))
        assert [v["version"] for v in remote] == [1, 2, 3]
