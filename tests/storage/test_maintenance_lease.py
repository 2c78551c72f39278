"""Maintenance that deletes (prune, gc, delete, dropping loose copies) holds the store's writer lease.

Bug fixed (issue 35): ``prune`` and ``gc`` did not consult the lease: ``ckptflow gc
--min-age 0`` under a live writer removed its saves in flight (the writer then failed
with ``SaveFailedError``, once with a raw ``FileNotFoundError``). Now each takes the
store's writer lease for its duration, or, while another live writer holds it, is
refused with :class:`StoreLockedError` naming the holder, and removes nothing. A store
that holds the lease itself (or is given it with ``store.write_under(lease)``), as the
training pipeline's retention at the end of a run is, prunes as before.

A real writer process holds the lease (``tests/children/writer_child.py``), on a local
directory and on a SeaweedFS S3 server; the CLI runs through typer's CliRunner.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.storage import CheckpointStore, StoreLease, StoreLockedError, read_lease
from ckptflow.storage.versions.lease import LEASE_FILE
from tests.conftest import StoreTarget
from tests.storage.test_single_writer import Writer

LEFTOVER = "v000050/shard-r0-00.h5"  # what a save in flight has written so far, as gc sees it


@pytest.fixture
def held(target: StoreTarget, tmp_path: Path) -> Iterator[Writer]:
    """A writer process that committed three versions and holds the lease (renewed) for a minute."""
    writer = Writer.holding(target, tmp_path / "go")
    try:
        target.raw_write(LEFTOVER, b"partial shard")
        yield writer
    finally:
        writer.kill()


def cli(target: StoreTarget, *args: str):
    options = ["--storage-options", json.dumps(target.storage_options)] if target.storage_options else []
    return CliRunner().invoke(app, [*args[:1], target.url, *args[1:], *options])


def state(target: StoreTarget) -> tuple[list[str], list[int]]:
    """What maintenance must not change: the files under the root, and the committed versions."""
    fs, root = target.raw_fs()
    files = sorted(p.removeprefix(root) for p in fs.find(root) if not p.endswith(LEASE_FILE))
    return files, [v.version for v in target.open().versions()]


class TestRefusedUnderALiveWriter:
    def test_gc_min_age_0_is_refused_naming_the_holder(self, target, held):
        """Bug: gc --min-age 0 under a live writer removed its save in flight and exited 0."""
        before = state(target)
        result = cli(target, "gc", "--min-age", "0")
        assert result.exit_code == 75, result.output  # refused: held (issue 53)
        assert result.stderr.startswith(f"error: {target.url} is in use by another writer: writer 1 (host ")
        assert f"pid {held.proc.pid}" in result.stderr
        assert len(result.stderr.splitlines()) == 1
        assert state(target) == before
        assert target.raw_exists(LEFTOVER)

    def test_prune_is_refused_naming_the_holder(self, target, held):
        before = state(target)
        result = cli(target, "prune", "--keep-last", "1")
        assert result.exit_code == 75, result.output
        assert result.stderr.startswith(f"error: {target.url} is in use by another writer: writer 1 (host ")
        assert state(target) == before == (before[0], [0, 1, 2])

    def test_dry_runs_read_only_and_are_not_refused(self, target, held):
        before = state(target)
        assert cli(target, "prune", "--keep-last", "1", "--dry-run").exit_code == 0
        gc = cli(target, "gc", "--min-age", "0", "--dry-run")
        assert gc.exit_code == 0, gc.output
        assert "would remove uncommitted" in gc.stdout and "v000050" in gc.stdout
        assert state(target) == before

    def test_archive_is_refused_naming_the_holder_and_writes_nothing(self, target, held):
        """Bug: ``ckptflow archive`` ran without the lease, beside a run whose own archive jobs may
        write the same tarball."""
        before = state(target)
        for args in (("--versions", "0-1", "--drop-loose"), ("--reindex",)):
            result = cli(target, "archive", *args)
            assert result.exit_code == 75, result.output
            assert result.stderr.startswith(
                f"error: {target.url} is in use by another writer: writer 1 (host "
            )
            assert f"pid {held.proc.pid}" in result.stderr
            assert state(target) == before
        assert not target.raw_exists("archive")
        assert read_lease(target.open().loc).pid == held.proc.pid

    def test_the_library_refuses_prune_gc_and_delete(self, target, held):
        store = target.open()
        before = state(target)
        for remove in (
            lambda: store.prune(keep_last=1),
            lambda: store.gc(),
            lambda: store.delete(0),
            lambda: store.drop_loose([0]),
        ):
            with pytest.raises(StoreLockedError, match="in use by another writer: writer 1") as err:
                remove()
            assert err.value.holder is not None and err.value.holder.pid == held.proc.pid
        assert state(target) == before
        held_by = read_lease(store.loc)
        assert held_by is not None and held_by.pid == held.proc.pid  # the writer's lease is untouched

    def test_the_writer_saves_on_and_gc_works_once_it_ends(self, target, held, tmp_path):
        assert cli(target, "gc", "--min-age", "0").exit_code == 75
        held.kill()  # its lease is taken over at once: its process has ended (local), or
        if target.is_s3:  # on S3 (no pid space to look into) once its timeout passed
            target.raw_remove(LEASE_FILE)
        result = cli(target, "gc", "--min-age", "0")
        assert result.exit_code == 0, result.output
        assert "removed uncommitted" in result.stdout and not target.raw_exists(LEFTOVER)
        assert not target.raw_exists(LEASE_FILE)  # gc released the lease it took
        assert [v.version for v in target.open().versions()] == [0, 1, 2]


class TestTheLeaseHolderPrunes:
    def _saved(self, target: StoreTarget, store: CheckpointStore) -> None:
        for epoch in range(4):
            store.save({"w": torch.full((16,), float(epoch))}, epoch=epoch)

    def test_a_store_holding_the_lease_prunes_and_collects(self, target):
        """The pipeline's own retention: the store that holds the lease prunes, as before."""
        store = target.open()
        with store.lease(owner="the run") as lease:
            self._saved(target, store)
            target.raw_write(LEFTOVER, b"partial shard")
            assert store.prune(keep_last=2) == [0, 1]
            assert store.gc() == [50]
            store.delete(2)
            assert read_lease(store.loc).token == lease.token  # still held, by this store
        assert [v.version for v in store.versions()] == [3]
        assert not target.raw_exists(LEASE_FILE)

    def test_a_store_given_the_lease_with_write_under_prunes(self, target):
        """The pipeline saves and prunes through another store object than the one that took the lease."""
        holder, run = target.open(), target.open()
        with holder.lease(owner="the flow") as lease:
            run.write_under(lease)
            self._saved(target, run)
            assert run.prune(keep_last=1) == [0, 1, 2]
            with pytest.raises(StoreLockedError, match="this process"):  # not given the lease: refused
                target.open().prune(keep_last=1)
        assert [v.version for v in run.versions()] == [3]

    def test_a_store_whose_lease_was_lost_does_not_prune(self, target):
        store = target.open()
        with store.lease(owner="the run", timeout=60) as lease:
            self._saved(target, store)
            target.raw_remove(LEASE_FILE)
            taker = StoreLease(target.open().loc, owner="another writer")
            taker.acquire()
            try:
                with pytest.raises(Exception, match="lost its lease"):
                    store.prune(keep_last=1)
            finally:
                taker.release()
            assert lease.token != taker.token
        assert [v.version for v in store.versions()] == [0, 1, 2, 3]

    def test_a_store_without_a_lease_takes_one_for_the_prune(self, target, monkeypatch):
        store = target.open()
        self._saved(target, store)
        seen = []
        real = StoreLease.acquire

        def acquire(self):
            seen.append(self.info.owner)
            return real(self)

        monkeypatch.setattr(StoreLease, "acquire", acquire)
        assert store.prune(keep_last=1) == [0, 1, 2]
        assert len(seen) == 1 and not target.raw_exists(LEASE_FILE)
