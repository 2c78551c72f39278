"""A failed archive leaves nothing behind, and gc removes and reports what a killed one left.

Bug fixed (issue 35): an archive whose index could not be written (a full disk) left the
whole tarball and an ``archive/.<name>.index.json.<hex>.tmp`` behind; ``gc --min-age 0``
then removed the tarball while printing "no uncommitted leftovers", and never removed the
temporary index. Now a failed archive removes its tarball and temporary index (as a failed
save removes its partial files), and gc counts, removes and reports both kinds of leftover
(tarballs without an index, temporary files older than ``--min-age``).

A real full disk (a small tmpfs; the test is skipped without root), real stores on every
backend (local, file://, memory://, a SeaweedFS S3 server) and the CLI through CliRunner.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.storage import CheckpointStore, StorageUnavailableError
from ckptflow.storage.archive import tarindex
from ckptflow.storage.archive.tarindex import index_name
from tests.conftest import StoreTarget, assert_same_state
from tests.disks import free_bytes, small_tmpfs

TAR = "epochs-000000-000001.tar"
PARTIAL = "epochs-000002-000003.tar"
PAGE = 4096


def make_state(tag: int) -> dict[str, object]:
    torch.manual_seed(tag)
    return {"w": torch.randn(40_000), "step": tag}  # 160 KB


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def pages(size: int) -> int:
    return -(-size // PAGE) * PAGE


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs: writes past its size fail with ENOSPC (needs root: mount)."""
    with small_tmpfs(tmp_path / "disk", "4m") as mountpoint:
        yield mountpoint


def archive_listing(root: Path) -> list[str]:
    archive = root / "archive"
    return sorted(os.listdir(archive)) if archive.exists() else []


class TestAFailedArchiveLeavesNothing:
    def test_a_full_disk_while_the_index_is_written(self, small_disk, tmp_path):
        """Bug: the tarball and a temporary index stayed after the index failed on a full disk."""
        root = small_disk / "store"
        store = CheckpointStore(str(root))
        states = {v: make_state(v) for v in (0, 1)}
        for v, state in states.items():
            store.save(state, epoch=v)
        reference = tmp_path / "reference"  # the same archive on a roomy disk: its sizes
        shutil.copytree(root, reference)
        CheckpointStore(str(reference)).archive([0, 1])
        tar_size = (reference / "archive" / TAR).stat().st_size
        assert (reference / "archive" / index_name(TAR)).stat().st_size > 0
        filler = small_disk / "filler"
        with open(filler, "wb") as f:  # room for the tar's pages, none for its index
            f.write(b"\0" * (free_bytes(small_disk) - pages(tar_size)))

        with pytest.raises(StorageUnavailableError, match="no space left on the device while archiving"):
            store.archive([0, 1])
        assert archive_listing(root) == []  # neither the tarball nor a temporary index
        assert [(v.version, v.archived) for v in store.versions()] == [(0, False), (1, False)]
        for v, state in states.items():
            assert_same_state(store.load(v), state)
        gc = invoke("gc", str(root), "--min-age", "0")
        assert gc.exit_code == 0 and gc.stdout.strip() == f"no uncommitted leftovers in {root}"

        filler.unlink()
        index = store.archive([0, 1])
        assert archive_listing(root) == [index_name(TAR), TAR] and index.size == tar_size

    def test_an_index_write_that_fails_removes_the_tarball(self, store_url, monkeypatch):
        """Where a full disk is impractical (object stores): the index's write raises ENOSPC."""
        target = store_url
        store = target.open()
        for v in (0, 1):
            store.save(make_state(v), epoch=v)

        def no_space(loc, name, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(tarindex, "write_file_atomic", no_space)
        with pytest.raises(StorageUnavailableError, match="no space left"):
            store.archive([0, 1])
        assert target.raw_listdir("archive") == []
        assert store.survey().bad_archives == {}
        assert [(v.version, v.archived) for v in store.versions()] == [(0, False), (1, False)]

    def test_a_failed_index_never_removes_another_writers_commit(self, store_url, monkeypatch):
        """Bug: the failure path removed the index and tarball, which could be another writer's
        commit of the same tarball (written meanwhile)."""
        target = store_url
        store = target.open()
        for v in (0, 1):
            store.save(make_state(v), epoch=v)
        theirs = b'{"another": "writer"}'
        real = tarindex.write_file_atomic

        def committed_meanwhile(loc, name, data):
            real(loc, name, theirs)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(tarindex, "write_file_atomic", committed_meanwhile)
        with pytest.raises(StorageUnavailableError, match="no space left"):
            store.archive([0, 1])
        assert target.raw_listdir("archive") == sorted([TAR, index_name(TAR)])
        assert target.raw_read(f"archive/{index_name(TAR)}") == theirs


@pytest.fixture
def leftovers(target: StoreTarget) -> StoreTarget:
    """A store with a committed tarball (versions 0-1), loose versions 2-3, and what an archive
    job of versions 2-3 killed before its index's rename leaves: the tarball without an index
    and, on a local disk, the index's temporary file."""
    store = target.open()
    for v in range(4):
        store.save(make_state(v), epoch=v)
    store.archive([0, 1])
    store.drop_loose([0, 1])
    target.raw_write(f"archive/{PARTIAL}", target.raw_read(f"archive/{TAR}"))
    if target.backend == "local":
        temp = Path(target.url) / "archive" / f".{index_name(PARTIAL)}.{uuid.uuid4().hex}.tmp"
        temp.write_bytes(target.raw_read(f"archive/{index_name(TAR)}")[:100])
    return target


def cli(target: StoreTarget, *args: str):
    options = ["--storage-options", json.dumps(target.storage_options)] if target.storage_options else []
    return CliRunner().invoke(app, [args[0], target.url, *args[1:], *options])


def age(target: StoreTarget, seconds: float) -> None:
    """Make every leftover under archive/ ``seconds`` old (local files only)."""
    if target.backend == "local":
        then = time.time() - seconds
        for p in (Path(target.url) / "archive").iterdir():
            os.utime(p, (then, then))


def temp_names(target: StoreTarget) -> list[str]:
    return [n for n in target.raw_listdir("archive") if n.endswith(".tmp")]


class TestGcOfArchiveLeftovers:
    def test_gc_removes_and_reports_both_kinds(self, leftovers):
        """Bug: gc --min-age 0 removed the tarball but printed "no uncommitted leftovers", and kept the
        temporary index for ever."""
        target = leftovers
        temps = temp_names(target)
        assert len(temps) == (1 if target.backend == "local" else 0)
        result = cli(target, "gc", "--min-age", "0")
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert f"removed {target.url}/archive/{PARTIAL}: a tarball without an index" in lines[0]
        assert lines[1:-1] == [
            f"removed {target.url}/archive/{t}: a temporary file of an interrupted write" for t in temps
        ]
        assert lines[-1].startswith("freed ") and lines[-1] != "freed 0 B"  # the partial tarball's bytes
        assert "no uncommitted leftovers" not in result.stdout
        assert target.raw_listdir("archive") == sorted([TAR, index_name(TAR)])
        assert [(v.version, v.archived) for v in target.open().versions()] == [
            (0, True),
            (1, True),
            (2, False),
            (3, False),
        ]
        again = cli(target, "gc", "--min-age", "0")
        assert again.stdout.strip() == f"no uncommitted leftovers in {target.url}"

    def test_recent_ones_are_spared_and_said_so_then_removed_when_old(self, leftovers):
        target = leftovers
        temps = temp_names(target)
        for args in (("--dry-run",), ()):
            result = cli(target, "gc", *args)
            assert result.exit_code == 0, result.output
            assert "no uncommitted leftovers" not in result.stdout
            assert (
                f"left {target.url}/archive/{PARTIAL}: changed in the last 900s, an archive job may be "
                "writing it (--min-age 0 removes it)"
            ) in result.stdout.splitlines()
            for t in temps:
                assert f"left {target.url}/archive/{t}: changed in the last 900s" in result.stdout
            assert target.raw_exists(f"archive/{PARTIAL}") and temp_names(target) == temps
        if target.backend != "local":
            return  # object stores: their modification times cannot be set back
        age(target, 3600)
        dry = cli(target, "gc", "--dry-run")
        assert dry.stdout.splitlines() == [
            f"would remove {target.url}/archive/{PARTIAL}: a tarball without an index (an interrupted "
            "archive job)",
            *(
                f"would remove {target.url}/archive/{t}: a temporary file of an interrupted write"
                for t in temps
            ),
        ]
        real = cli(target, "gc")
        *done, freed = real.stdout.splitlines()
        assert [line.replace("removed", "would remove") for line in done] == dry.stdout.splitlines()
        assert freed.startswith("freed ")  # what a dry run does not say
        assert target.raw_listdir("archive") == sorted([TAR, index_name(TAR)])

    def test_the_library_reports_them(self, leftovers):
        target = leftovers
        store = target.open()
        temps = temp_names(target)
        report = store.collect_garbage(min_age=0, dry_run=True)
        assert (report.removed.versions, report.removed.tarballs) == ((), (PARTIAL,))
        assert report.removed.temp_files == tuple(f"archive/{t}" for t in temps)
        assert target.raw_exists(f"archive/{PARTIAL}")
        done = store.collect_garbage(min_age=0)
        assert done.removed == report.removed and not done.spared
        assert store.gc() == [] and not target.raw_exists(f"archive/{PARTIAL}")
