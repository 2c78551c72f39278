"""Background saves: ``save_async`` copies, then writes and commits in the background.

What must hold: the call returns once the state is copied (training may change
its tensors right away); at most one save is in flight, and any later save
(async or not) waits for it; a background failure is never lost: ``wait()``
raises it, or else the next save / ``store.wait()`` / ``close()`` does, and
the previous committed version stays the latest; the staging buffer is
allocated once and reused.

A *gate* holds the background writer before its first byte, so "the save is
still running" is a fact of the test, not a race.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from ckptflow.storage import CheckpointStore, SaveFailedError, StoreOptions
from ckptflow.storage.save import writer as writer_module

from .test_crash_safety import assert_bitwise_equal

MIB = 8


def make_state(seed: int, mib: int = MIB) -> dict[str, Any]:
    """A small training-like state: model, optimizer-like nesting, several dtypes."""
    gen = torch.Generator().manual_seed(seed)
    n = (mib << 20) // 4 // 4
    return {
        "model": {
            "w1": torch.randn(n // 256, 256, generator=gen),
            "w2": torch.randn(n, generator=gen).to(torch.bfloat16),
            "index": torch.randint(0, 1 << 40, (1000,), generator=gen),
            "mask": torch.rand(100, generator=gen) > 0.5,
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(n, generator=gen)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
        },
        "epoch": seed,
    }


def tensors(state: Any) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from tensors(value)


def clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(clone(v) for v in state)
    return state


def mutate_(state: Any) -> None:
    """Change every tensor in place, the way an optimizer step does."""
    for t in tensors(state):
        if t.dtype == torch.bool:
            t.logical_not_()
        else:
            t.add_(1)


class Gate:
    """Holds every background write before its first byte until :meth:`release`."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []

    def release(self) -> None:
        self._open.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    real = writer_module.write_shards

    def gated(*args: Any, **kwargs: Any):
        name = threading.current_thread().name
        g.threads.append(name)
        if name.startswith("ckptflow-async-save"):
            g.entered.set()
            assert g._open.wait(60), "the test never released the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "write_shards", gated)
    yield g
    g.release()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    s = CheckpointStore(tmp_path / "store", options=StoreOptions(shards=3, threads=2))
    yield s
    with contextlib.suppress(SaveFailedError):  # a test may leave a failed save behind
        s.close()


def run_in_thread(fn) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


class TestSaveAsyncReturnsAfterCopy:
    def test_changes_after_return_are_not_in_the_checkpoint(self, store: CheckpointStore, gate: Gate) -> None:
        state = make_state(1)
        before = clone(state)
        handle = store.save_async(state, epoch=1)
        assert gate.entered.wait(30), "the background write never started"
        assert not handle.done()  # returned while the write has not written a byte
        mutate_(state)
        gate.release()
        info = handle.wait(timeout=60)

        assert (info.version, info.epoch) == (1, 1)  # the version follows the epoch
        assert any(n.startswith("ckptflow-async-save") for n in gate.threads)
        assert_bitwise_equal(store.load(1), before)
        assert not torch.equal(state["model"]["w1"], before["model"]["w1"])  # the change did happen


class TestOneSaveInFlight:
    def test_second_save_async_waits_for_the_first(self, store: CheckpointStore, gate: Gate) -> None:
        first, second = make_state(1), make_state(2)
        h1 = store.save_async(first, epoch=1)
        assert gate.entered.wait(30)
        thread, out = run_in_thread(lambda: store.save_async(second, epoch=2))
        thread.join(0.5)
        assert thread.is_alive(), f"the second save_async did not wait for the first: {out}"
        assert not h1.done()
        gate.release()
        thread.join(60)
        assert not thread.is_alive() and "error" not in out, out
        assert h1.done()  # it returned only after the first one ended
        h2 = out["result"]
        info1, info2 = h1.wait(timeout=60), h2.wait(timeout=60)

        assert (info1.version, info2.version) == (1, 2)
        assert [(v.version, v.epoch) for v in store.versions()] == [(1, 1), (2, 2)]
        assert_bitwise_equal(store.load(1), make_state(1))
        assert_bitwise_equal(store.load(2), make_state(2))

    def test_sync_save_waits_for_the_async_save_in_flight(self, store: CheckpointStore, gate: Gate) -> None:
        handle = store.save_async(make_state(1), epoch=1)
        assert gate.entered.wait(30)
        thread, out = run_in_thread(lambda: store.save(make_state(2), epoch=2))
        thread.join(0.5)
        assert thread.is_alive(), f"save did not wait for the async save in flight: {out}"
        assert [v.version for v in store.versions()] == []
        gate.release()
        thread.join(60)
        assert not thread.is_alive() and "error" not in out, out
        assert handle.done()

        assert (handle.wait().version, out["result"].version) == (1, 2)
        assert [(v.version, v.epoch) for v in store.versions()] == [(1, 1), (2, 2)]
        assert_bitwise_equal(store.load(1), make_state(1))
        assert_bitwise_equal(store.load(2), make_state(2))


class TestStagingBufferReused:
    def test_second_save_of_the_same_state_reuses_the_buffer(self, store: CheckpointStore) -> None:
        state = make_state(1)
        store.save_async(state, epoch=1).wait(timeout=60)
        capacity = store._saves.staging.capacity
        buffer = store._saves.staging._buffer
        pointer = buffer.data_ptr()
        assert capacity >= sum(t.numel() * t.element_size() for t in tensors(state))

        mutate_(state)
        expected = clone(state)
        store.save_async(state, epoch=2).wait(timeout=60)
        assert store._saves.staging.capacity == capacity
        assert store._saves.staging._buffer is buffer and buffer.data_ptr() == pointer
        assert_bitwise_equal(store.load(2), expected)
        assert_bitwise_equal(store.load(1), make_state(1))


# -- failures in the background ---------------------------------------------------


class FailingWrites:
    """Makes writes of files under one version dir fail with EIO after their first write call."""

    def __init__(self, fs: fsspec.AbstractFileSystem, version_dir: str) -> None:
        self.fs = fs
        self.marker = f"/{version_dir}/"
        self.active = True
        self.bytes_before_failure = 0
        self.failures = 0
        self._real_open = fs.open

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any):
        f = self._real_open(path, mode, *args, **kwargs)
        if self.active and "w" in mode and self.marker in path:
            return _FailingFile(f, self)
        return f


class _FailingFile:
    def __init__(self, f: Any, owner: FailingWrites) -> None:
        self._f = f
        self._owner = owner
        self._calls = 0

    def write(self, data: Any) -> int:
        self._calls += 1
        if self._calls > 1:
            self._owner.failures += 1
            raise OSError(errno.EIO, "injected I/O error", getattr(self._f, "path", "?"))
        self._owner.bytes_before_failure += len(data)
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@pytest.fixture
def memory_url() -> Iterator[str]:
    name = f"ckpt-async-{uuid.uuid4().hex}"
    yield f"memory://{name}/store"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


SURFACES = ["handle.wait", "next save", "next save_async", "store.wait", "close"]


class TestBackgroundFailure:
    @pytest.mark.parametrize("surface", SURFACES)
    def test_failure_is_raised_once_and_the_previous_version_stays(
        self, memory_url: str, monkeypatch: pytest.MonkeyPatch, surface: str
    ) -> None:
        store = CheckpointStore(memory_url, options=StoreOptions(shards=2, threads=2))
        committed = make_state(0)
        store.save(committed, epoch=0)
        faults = FailingWrites(store.loc.fs, "v000001")
        monkeypatch.setattr(store.loc.fs, "open", faults.open)

        handle = store.save_async(make_state(1), epoch=1)
        with pytest.raises(SaveFailedError) as caught:
            if surface == "handle.wait":
                handle.wait(timeout=60)
            elif surface == "next save":
                store.save(make_state(2), epoch=2)
            elif surface == "next save_async":
                store.save_async(make_state(2), epoch=2)
            elif surface == "store.wait":
                store.wait()
            else:
                store.close()
        assert faults.failures >= 1 and faults.bytes_before_failure > 0  # it failed mid-write
        cause = caught.value.__cause__
        assert isinstance(cause, OSError) and cause.errno == errno.EIO, repr(cause)
        assert "version 1" in str(caught.value) and "injected I/O error" in str(caught.value)
        assert handle.done()

        faults.active = False
        if surface == "close":
            store = CheckpointStore(memory_url, options=StoreOptions(shards=2, threads=2))
        else:
            assert store.wait() is None  # reported once, not again
        assert [v.version for v in store.versions()] == [0]
        assert store.latest().version == 0
        assert_bitwise_equal(store.load(), committed)

        info = store.save(make_state(2), epoch=2)  # nothing of the failure left to raise
        assert info.version > 0 and store.latest().version == info.version
        assert_bitwise_equal(store.load(), make_state(2))
        assert set(store.gc()) <= {1}
        assert [v.version for v in store.versions()] == [0, info.version]
        store.close()


def test_staging_copies_in_pieces_on_several_threads_exactly(monkeypatch):
    """Large stagings are cut into pieces copied by several threads: every byte lands where it belongs."""
    from ckptflow.storage.format.structure import encode
    from ckptflow.storage.save import staging
    from ckptflow.storage.save.planner import plan_blobs

    monkeypatch.setattr(staging, "PIECE", 4096 + 13)  # pieces that cut through tensors at odd offsets
    monkeypatch.setattr(staging, "PARALLEL_FROM", 1)
    monkeypatch.setattr(staging, "COPY_THREADS", 3)
    gen = torch.Generator().manual_seed(5)
    state = {
        "big": torch.randn(300, 257, generator=gen),
        "odd": torch.randint(0, 255, (12345,), dtype=torch.uint8, generator=gen),
        "strided": torch.randn(64, 64, generator=gen).t(),  # not contiguous: copied by torch
        "empty": torch.empty(0),
        "bf16": torch.randn(999, generator=gen).to(torch.bfloat16),
    }
    _, leaves = encode(state)
    blobs, _ = plan_blobs(leaves)
    buffer = staging.StagingBuffer()
    try:
        views = buffer.stage(blobs)
        for blob in blobs:
            expected = blob.source.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert bytes(views[blob.index]) == expected, blob.name
    finally:
        buffer.release()


def test_overlapped_staging_gives_each_blob_its_bytes_and_reuses_the_buffer():
    """``stage_overlapped`` (a sync save's device chunks: each written once its own copy ends):
    the bytes handed out are each blob's as they were at the call, in the same reused buffer.
    Here every blob is on the host, so the copies end before the call returns; on CUDA each
    blob's copy is waited for by its own event (bench/bench_sharded.py --device cuda runs it)."""
    from ckptflow.storage.format.structure import encode
    from ckptflow.storage.save import staging
    from ckptflow.storage.save.planner import plan_blobs

    gen = torch.Generator().manual_seed(7)
    state = {
        "w": torch.randn(128, 33, generator=gen),
        "strided": torch.randn(40, 40, generator=gen).t(),
        "empty": torch.empty(0),
        "step": torch.tensor(3.0),
    }
    _, leaves = encode(state)
    blobs, _ = plan_blobs(leaves)
    expected = {b.index: b.source.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for b in blobs}
    buffer = staging.StagingBuffer()
    try:
        bytes_of = buffer.stage_overlapped(blobs)
        pointer = buffer._buffer.data_ptr()
        for tensor in state.values():
            tensor.add_(1)  # training goes on: the staged bytes are the call's
        assert {b.index: bytes(bytes_of(b)) for b in blobs} == expected
        again = buffer.stage_overlapped(blobs)
        assert buffer._buffer.data_ptr() == pointer
        assert (
            bytes(again(blobs[0]))
            == blobs[0].source.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    finally:
        buffer.release()
