"""One writer per store: no commit is ever overwritten, and a lease keeps a second writer out.

Bug fixed: two processes saving to one store at once both picked the same
next version number, wrote their shards into the same directory and each
replaced the other's manifest; both were told "committed", and versions
failed their own checksums or held the other writer's data. Now a version
number is claimed exclusively before any shard is written (the next free one
is taken when the automatic number is claimed), a manifest is created only if
absent, and a writer can hold the store's lease (``CheckpointStore.lease``),
which a second writer cannot take while the holder lives.

Real processes, real files and a real S3 protocol server (SeaweedFS).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptflow.storage import (
    CheckpointStore,
    LeaseInfo,
    LeaseLostError,
    StoreLease,
    StoreLockedError,
    VersionTakenError,
    current_process,
    read_lease,
)
from ckptflow.storage.info import SaveRequest
from ckptflow.storage.versions import claims
from ckptflow.storage.versions import commit as protocol
from ckptflow.storage.versions import lease as lease_module
from ckptflow.storage.versions.lease import LEASE_FILE
from tests.children import CHILDREN
from tests.children.writer_child import make_state
from tests.conftest import StoreTarget, assert_same_state

CHILD = CHILDREN / "writer_child.py"
ROOT_DIR = Path(__file__).resolve().parents[2]
SAVES = 6


@dataclass
class Writer:
    proc: subprocess.Popen
    out: Path

    @classmethod
    def start(cls, target: StoreTarget, tag: int, count: int, go: Path, *extra: str) -> Writer:
        out = go.parent / f"writer-{tag}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT_DIR)}
        env["CKPTFLOW_STORAGE_OPTIONS"] = json.dumps(target.storage_options)
        with open(out, "wb") as sink:
            cmd = [sys.executable, str(CHILD), target.url, str(tag), str(count), str(go), *extra]
            proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT_DIR)
        return cls(proc, out)

    @classmethod
    def holding(cls, target: StoreTarget, go: Path, saves: int = 3) -> Writer:
        """A writer that committed ``saves`` versions and holds the lease (renewed) for two minutes."""
        writer = cls.start(target, 1, saves, go, "--lease", "30", "--hold", "120")
        try:
            writer.wait_line("ready")
            go.touch()
            writer.wait_line("leased")
            deadline = time.monotonic() + 120
            while len(committed_lines(writer.lines())) < saves:
                assert time.monotonic() < deadline, writer.out.read_text()
                assert writer.proc.poll() is None, writer.out.read_text()
                time.sleep(0.05)
        except BaseException:
            writer.kill()
            raise
        return writer

    def lines(self) -> list[str]:
        return self.out.read_text(errors="replace").splitlines()

    def wait_line(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            found = [ln for ln in self.lines() if ln.startswith(prefix)]
            if found:
                return found[0]
            assert self.proc.poll() is None, f"writer exited before {prefix!r}:\n{self.out.read_text()}"
            assert time.monotonic() < deadline, f"no {prefix!r} within {timeout}s:\n{self.out.read_text()}"
            time.sleep(0.02)

    def finish(self, timeout: float = 120.0) -> list[str]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return self.lines()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def committed_lines(lines: list[str]) -> dict[int, int]:
    """version -> save index, from a writer's ``committed V I`` lines."""
    return {int(v): int(i) for kind, v, i in (ln.split()[:3] for ln in lines if ln.startswith("committed "))}


def write_lease(target: StoreTarget, info: LeaseInfo) -> None:
    target.raw_write(LEASE_FILE, info.to_json())


def foreign_lease(*, age: float, timeout: float, host: str = "other-host") -> LeaseInfo:
    now = time.time()
    return LeaseInfo("someone else", host, 4242, now - age - 5, now - age, timeout, "f" * 32)


class TestConcurrentSaves:
    """Two processes saving at once: every commit is whole, its writer's own, and never replaced."""

    def test_two_writers_never_share_or_overwrite_a_version(self, target: StoreTarget, tmp_path: Path):
        """Bug fixed: both writers committed the same version numbers over each other's shards."""
        go = tmp_path / "go"
        writers = [Writer.start(target, tag, SAVES, go) for tag in (1, 2)]
        try:
            for w in writers:
                w.wait_line("ready")
            go.touch()
            outputs = [w.finish() for w in writers]
        finally:
            for w in writers:
                w.kill()
        reported = [committed_lines(out) for out in outputs]
        failures = [ln for out in outputs for ln in out if ln.startswith(("failed", "Traceback"))]
        assert not failures, outputs
        assert all(len(r) == SAVES for r in reported), outputs
        assert not set(reported[0]) & set(reported[1]), f"one version reported by both writers: {outputs}"

        store = CheckpointStore(target.url, storage_options=target.storage_options)
        listed = [v.version for v in store.versions()]
        assert sorted(listed) == sorted([*reported[0], *reported[1]])
        for v in listed:
            store.verify(v)  # every shard matches its manifest's checksum
            tag, i = store.manifest(v).user["tag"], store.manifest(v).user["i"]
            assert reported[tag - 1][v] == i, f"version {v} holds writer {tag}'s save {i}: {outputs}"
            assert_same_state(store.load(v), make_state(tag, i))
        assert sorted(protocol.list_dirs(store.loc)) == sorted(listed)  # nothing left half-written
        assert claims.stray_claims(store.loc) == []

    def test_a_version_being_written_is_refused_to_a_second_writer(self, store_url: StoreTarget):
        """Bug fixed: a second writer of the same explicit version removed the first one's shards."""
        first, second = store_url.open(), store_url.open()
        state = {"x": torch.arange(1000, dtype=torch.float32)}
        job = first._saves.writer.prepare(
            state, SaveRequest(epoch=5, version=5)
        )  # claimed, nothing written yet
        with pytest.raises(VersionTakenError) as caught:
            second.save({"x": torch.zeros(1000)}, version=5)
        message = str(caught.value)
        assert "version 5" in message and "being written by another writer" in message
        assert f"pid {os.getpid()}" in message and "ckptflow gc" in message
        as_bytes = lambda b: memoryview(b.source.numpy()).cast("B")  # noqa: E731
        info = first._saves.writer.write(job, as_bytes, as_bytes)
        assert info.version == 5
        assert_same_state(store_url.open().load(5), state)
        assert claims.read_claim(first.loc, 5) is None  # the commit removed the claim

    def test_a_commit_never_replaces_another_writers_manifest(self, store_url: StoreTarget):
        """Bug fixed: the manifest was renamed (locally) or PUT (S3) over one already committed."""
        store = store_url.open()
        mine = store.save({"x": torch.ones(10)}, version=2)
        before = store_url.raw_read("v000002/manifest.json")
        other = store.manifest(2).model_copy(update={"metrics": {"loss": 1.0}})
        with pytest.raises(VersionTakenError, match="another writer committed version 2"):
            protocol.commit(store.loc, other)
        assert store_url.raw_read("v000002/manifest.json") == before
        assert store_url.open().info(2) == mine

    def test_a_number_committed_since_it_was_picked_is_not_claimed(self, store_url: StoreTarget):
        """Bug fixed: a writer that picked version 2 just before another committed it (and removed
        its claim) claimed it all the same, wrote its shards there and failed at its commit."""
        store = store_url.open()
        store.save({"x": torch.ones(10)}, version=2)  # committed; its claim is gone
        assert not claims.claim_version(store.loc, 2, claims.new_claim("e" * 32))
        assert not store_url.raw_exists("v000002/.claim.json")  # and no claim of its own left there
        assert store.save({"x": torch.zeros(10)}).version == 3

    def test_a_writer_whose_claim_was_taken_does_not_commit(self, store_url: StoreTarget):
        """A writer judged gone whose version was claimed by another fails its commit and exposes nothing."""
        store = store_url.open()
        state = {"x": torch.arange(100, dtype=torch.float32)}
        job = store._saves.writer.prepare(state, SaveRequest(epoch=3, version=3))
        claim = claims.read_claim(store.loc, 3)
        assert claim is not None
        taken = replace(claim, token="0" * 32)

        def bytes_while_taken(blob: Any) -> memoryview:  # another writer claims it mid-write
            store_url.raw_write("v000003/.claim.json", json.dumps(taken.__dict__).encode())
            return memoryview(blob.source.numpy()).cast("B")

        with pytest.raises(VersionTakenError, match="claimed by another writer"):
            store._saves.writer.write(job, bytes_while_taken, bytes_while_taken)
        assert store_url.open().find(3) is None
        assert not store_url.raw_exists("v000003/manifest.json")
        assert claims.read_claim(store.loc, 3) == taken  # the other writer's claim stays

    def test_leftovers_of_a_writer_that_is_gone_are_cleared(self, store_url: StoreTarget):
        """A retried save of a version whose writer died (same host, process gone) writes it again."""
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        claim = claims.Claim("d" * 32, socket.gethostname(), dead.pid, time.time(), "1", current_process()[3])
        store_url.raw_write("v000004/.claim.json", json.dumps(claim.__dict__).encode())
        store_url.raw_write("v000004/shard-r0-00.h5", b"half a shard")
        state = {"x": torch.full((64,), 4.0)}
        assert store_url.open().save(state, version=4).version == 4
        assert_same_state(store_url.open().load(4), state)

    def test_gc_removes_the_claim_a_writer_killed_after_its_commit_left(self, store_url: StoreTarget):
        store = store_url.open()
        store.save({"x": torch.ones(4)}, version=1)
        claim = claims.Claim("c" * 32, "other-host", 1, time.time())
        store_url.raw_write("v000001/.claim.json", json.dumps(claim.__dict__).encode())
        assert store.gc() == []
        assert not store_url.raw_exists("v000001/.claim.json")
        assert_same_state(store_url.open().load(1), {"x": torch.ones(4)})


class TestLease:
    """The store's writer lease: exclusive, renewed, refused with its holder named, taken over when stale."""

    def test_a_second_writer_is_refused_naming_the_holder(self, target: StoreTarget, tmp_path: Path):
        go = tmp_path / "go"
        go.touch()
        holder = Writer.start(target, 1, 1, go, "--lease", "30", "--hold", "60")
        try:
            holder.wait_line("committed")
            store = CheckpointStore(target.url, storage_options=target.storage_options)
            with pytest.raises(StoreLockedError) as caught, store.lease(owner="second"):
                pass
            message = str(caught.value)
            assert "in use by another writer: writer 1" in message
            assert f"host {socket.gethostname()}, pid {holder.proc.pid}" in message
            assert "wait for it to end" in message and "taken over 30s after its last renewal" in message
            assert caught.value.holder.pid == holder.proc.pid
            late = Writer.start(target, 2, 1, go, "--lease", "30")
            assert late.finish()[-1].startswith("refused ") and late.proc.returncode == 3

            holder.kill()  # SIGKILL: no release; its process is gone, so this host takes it at once
            with store.lease(owner="after") as mine:
                assert read_lease(store.loc).token == mine.token
                assert store.save({"x": torch.ones(3)}).version == 1
            assert read_lease(store.loc) is None
        finally:
            holder.kill()

    def test_a_save_without_the_lease_is_refused_while_a_live_writer_holds_it(
        self, target: StoreTarget, tmp_path: Path
    ):
        """Bug fixed: the lease kept out only writers that asked for it; a plain ``store.save`` from
        another process (a spec saving from inside a run) committed under a live holder's lease."""
        holder = Writer.holding(target, tmp_path / "go", saves=1)
        try:
            store = CheckpointStore(target.url, storage_options=target.storage_options)
            with pytest.raises(StoreLockedError) as caught:
                store.save({"x": torch.ones(3)}, epoch=2)
            message = str(caught.value)
            assert "in use by another writer: writer 1" in message, message
            assert f"pid {holder.proc.pid}" in message
            with pytest.raises(StoreLockedError, match="writer 1"):
                store.save_async({"x": torch.ones(3)}).wait()
            with pytest.raises(StoreLockedError, match="writer 1"):
                store.save({"x": torch.ones(3)}, version=7)
            assert [v.version for v in store.versions()] == [0]  # the holder's own save alone
            assert [v.user.get("tag") for v in store.versions()] == [1]
            assert not target.raw_exists("v000007/manifest.json")
        finally:
            holder.kill()
        assert store.save({"x": torch.ones(3)}).version == 1  # its holder is gone: plain saves again

    def test_in_the_holders_process_only_the_store_holding_the_lease_commits(self, target: StoreTarget):
        """Bug fixed: a second ``CheckpointStore`` on the same URL in the lease holder's own process
        (a spec's ``CheckpointStore(self.run.storage).save(...)`` in the flow's process) committed
        versions the holder then took for its own."""
        holding = CheckpointStore(target.url, storage_options=target.storage_options)
        other = CheckpointStore(target.url, storage_options=target.storage_options)
        with holding.lease(owner="the run") as lease:
            assert holding.save({"x": torch.ones(2)}, epoch=1).version == 1
            with pytest.raises(StoreLockedError) as caught:
                other.save({"x": torch.zeros(2)}, epoch=2)
            message = str(caught.value)
            assert "the run" in message and "this process" in message, message
            assert "write_under" in message
            other.write_under(lease)  # the documented way to share the holder's lease
            assert other.save({"x": torch.zeros(2)}, epoch=2).version == 2
        assert [v.version for v in holding.versions()] == [1, 2]

    def test_the_holder_renews_its_lease(self, target: StoreTarget, tmp_path: Path):
        go = tmp_path / "go"
        go.touch()
        holder = Writer.start(target, 1, 0, go, "--lease", "1.2", "--hold", "60")
        try:
            holder.wait_line("leased")
            store = CheckpointStore(target.url, storage_options=target.storage_options)
            first = read_lease(store.loc)
            time.sleep(2.5)  # longer than the timeout: only renewals keep it live
            later = read_lease(store.loc)
            assert first is not None and later is not None and later.token == first.token
            assert later.renewed > first.renewed and later.started == first.started
            with pytest.raises(StoreLockedError, match="writer 1"), store.lease():
                pass
        finally:
            holder.kill()

    def test_a_lease_not_renewed_within_its_timeout_is_taken_over(self, target: StoreTarget, caplog):
        store = CheckpointStore(target.url, storage_options=target.storage_options)
        write_lease(target, foreign_lease(age=1, timeout=60))  # another host, renewed a second ago
        with (
            pytest.raises(StoreLockedError, match=r"host other-host, pid 4242.*in about 5[6-9]s"),
            store.lease(),
        ):
            pass
        write_lease(target, foreign_lease(age=10, timeout=5))  # silent for twice its timeout
        with store.lease(owner="taker") as mine:
            assert read_lease(store.loc).token == mine.token
        assert "stopped renewing it (timeout 5s)" in caplog.text
        assert read_lease(store.loc) is None

    def test_a_lease_is_taken_over_at_once_only_when_its_holder_is_certainly_gone(
        self, target: StoreTarget, caplog
    ):
        """A pid names a process only within one boot and pid namespace. Bug fixed: a live writer in
        another container with this host's name (host networking) was taken for gone, its pid being
        unknown here, and its lease taken over at once; a pid given to a later process kept a dead
        holder's lease until its timeout."""
        store = CheckpointStore(target.url, storage_options=target.storage_options)
        here = socket.gethostname()
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        try:
            live = dataclasses.asdict(foreign_lease(age=0, timeout=60, host=here))  # as a writer writes it
            other_container = {**live, "pid": gone.pid, "start": "1", "space": "another-boot/pid:[1]"}
            older_ckptflow = {**live, "pid": gone.pid}  # no start or space: cannot tell
            for lease in (other_container, older_ckptflow):
                target.raw_write(LEASE_FILE, json.dumps(lease).encode())
                with pytest.raises(StoreLockedError, match=f"host {here}, pid {gone.pid}"), store.lease():
                    pass
            reused = {
                **live,
                "pid": later.pid,
                "start": "1",  # not `later`'s start: a later process under a dead holder's pid
                "space": current_process()[3],
            }
            target.raw_write(LEASE_FILE, json.dumps(reused).encode())
            with store.lease(owner="taker") as mine:
                assert read_lease(store.loc).token == mine.token
            assert f"pid {later.pid}" in caplog.text and "is no longer running" in caplog.text
        finally:
            later.kill()
            later.wait()

    def test_a_lease_is_released_when_its_holder_ends(self, target: StoreTarget):
        store = CheckpointStore(target.url, storage_options=target.storage_options)
        with store.lease(owner="first") as held:
            assert held.is_held() and target.raw_exists(LEASE_FILE)
            store.save({"x": torch.ones(2)})
        assert not target.raw_exists(LEASE_FILE) and not held.is_held()
        with store.lease(owner="second"):
            assert store.save({"x": torch.ones(2)}).version == 1

    def test_a_writer_that_lost_its_lease_commits_nothing(self, target: StoreTarget):
        store = CheckpointStore(target.url, storage_options=target.storage_options)
        with store.lease(owner="slow", timeout=0.6) as held:
            write_lease(target, foreign_lease(age=0, timeout=60))  # taken over by another writer
            deadline = time.monotonic() + 10
            while held.is_held() and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(LeaseLostError, match="someone else"):
                store.save({"x": torch.ones(2)})
        assert store.versions() == []
        assert read_lease(store.loc).owner == "someone else"  # the other writer's lease stays

    def test_two_takers_of_a_stale_local_lease_one_wins(self, tmp_path: Path):
        target = StoreTarget("local", str(tmp_path / "store"), None)
        write_lease(target, foreign_lease(age=100, timeout=5))
        store = CheckpointStore(target.url)
        takers = [StoreLease(store.loc, owner=f"taker {i}", timeout=60) for i in range(8)]
        barrier = threading.Barrier(len(takers))
        outcome: dict[int, Any] = {}

        def take(i: int) -> None:
            barrier.wait()
            try:
                outcome[i] = takers[i].acquire()
            except StoreLockedError as exc:
                outcome[i] = exc

        threads = [threading.Thread(target=take, args=(i,)) for i in range(len(takers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, got in outcome.items() if isinstance(got, StoreLease)]
        try:
            assert len(winners) == 1, outcome
            assert read_lease(store.loc).token == takers[winners[0]].token
            assert all(
                f"taker {winners[0]}" in str(got)
                for got in outcome.values()
                if not isinstance(got, StoreLease)
            )
        finally:
            for t in takers:
                t.release()

    @pytest.mark.s3
    def test_two_takers_of_a_stale_s3_lease_one_wins(self, s3_bucket, monkeypatch):
        """Both takers read the stale lease; the second's conditional PUT (If-Match) fails."""
        bucket, options = s3_bucket
        target = StoreTarget("s3", f"s3://{bucket}/run1", options)
        write_lease(target, foreign_lease(age=100, timeout=5))
        store = CheckpointStore(target.url, storage_options=options)
        stale = lease_module._read_remote(store.loc)
        with StoreLease(store.loc, owner="first taker") as first:
            reads = iter([stale])
            real = lease_module._read_remote
            monkeypatch.setattr(lease_module, "_read_remote", lambda loc: next(reads, None) or real(loc))
            second = StoreLease(store.loc, owner="second taker")
            with pytest.raises(StoreLockedError, match="first taker"):
                second.acquire()
            assert read_lease(store.loc).token == first.token


def test_a_lease_not_renewed_within_its_timeout_fences_its_own_writer(tmp_path) -> None:
    """A holder that could not renew for its timeout may have been taken over: it commits nothing."""
    import dataclasses

    import torch

    from ckptflow.storage import CheckpointStore, LeaseLostError

    store = CheckpointStore(tmp_path / "store")
    with store.lease(timeout=60) as lease:
        lease.info = dataclasses.replace(lease.info, renewed=lease.info.renewed - 120)
        with pytest.raises(LeaseLostError, match="last renewed"):
            store.save({"w": torch.ones(2)}, epoch=1)
    assert store.versions() == []


def test_a_holder_frozen_before_its_commit_never_commits_after_a_takeover(tmp_path, monkeypatch) -> None:
    """Bug fixed: a holder frozen between its commit's lease check and the manifest's link still
    committed, seconds after another writer had taken the lease over. On a local disk the check and
    the link now happen under the root's flock, which every takeover takes too: a version is
    committed only before the takeover, or not at all."""
    from ckptflow.storage.save import saving

    store = CheckpointStore(tmp_path / "store")
    events: list[str] = []
    real_commit = saving.protocol.commit

    def frozen_commit(loc, manifest, **kwargs):  # type: ignore[no-untyped-def]
        stale = dataclasses.replace(read_lease(loc), renewed=time.time() - 600)  # as if frozen long
        (tmp_path / "store" / LEASE_FILE).write_bytes(stale.to_json())
        taker = StoreLease(loc, owner="the next run", timeout=60)

        def take_over() -> None:
            taker.acquire()
            events.append("taken over")

        thread = threading.Thread(target=take_over, daemon=True)
        thread.start()
        thread.join(2.0)  # the freeze: a takeover that can happen now does
        takers.append((thread, taker))
        real_commit(loc, manifest, **kwargs)
        events.append("committed")

    takers: list[tuple[threading.Thread, StoreLease]] = []
    with store.lease(owner="frozen", timeout=60):
        monkeypatch.setattr(saving.protocol, "commit", frozen_commit)
        try:
            store.save({"x": torch.ones(2)}, epoch=1)
        except LeaseLostError:
            events.append("refused")
        monkeypatch.setattr(saving.protocol, "commit", real_commit)
        [(thread, taker)] = takers
        thread.join(30)
        taker.release()
    assert "taken over" in events, events
    assert events[0] != "taken over" or "committed" not in events, events
    assert [v.version for v in store.versions()] == ([1] if "committed" in events else [])


def test_a_child_forked_while_the_root_is_locked_does_not_keep_it_locked(tmp_path) -> None:
    """Bug fixed: the root's flock was released only by closing its descriptor, but a flock belongs
    to the open file, which a process forked meanwhile shares (DataLoader workers forked while an
    async save committed): the store stayed locked until the child exited, and renewals and commits
    hung. The lock is now released explicitly."""
    import fcntl
    import signal

    root = tmp_path / "store"
    root.mkdir()
    with lease_module._root_lock(str(root)):
        pid = os.fork()
        if pid == 0:  # the worker: lives on after the lock's block
            time.sleep(30)
            os._exit(0)
    try:
        fd = os.open(root, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while the child holds it
        finally:
            os.close(fd)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_maintenance_in_another_thread_leaves_an_async_saves_failure_to_the_saver(tmp_path, monkeypatch):
    """Bug fixed: gc, prune or an archive job's drop_loose in a background thread waited for the async
    save in flight by taking its result: its failure was raised there (the archive job failed, for
    the save's reason) and the saving thread never heard of it."""
    from ckptflow.storage import SaveFailedError
    from ckptflow.storage.save import writer

    store = CheckpointStore(tmp_path / "store")
    store.save({"x": torch.ones(2)}, epoch=1)
    gate = threading.Event()

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        gate.wait(10)
        raise OSError(5, "the disk failed")

    monkeypatch.setattr(writer, "_write_shard", failing)
    handle = store.save_async({"x": torch.zeros(2)}, epoch=2)
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(store.gc(min_age=0)))
    thread.start()
    gate.set()
    thread.join(30)
    assert outcome == [[]], outcome  # gc ran, after the save ended, and raised nothing of it
    with pytest.raises(SaveFailedError):
        handle.wait()
    assert [v.version for v in store.versions()] == [1]
