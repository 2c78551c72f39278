"""Saves and loads pause Python's cyclic garbage collector, and leave it as they found it."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from ckptflow.storage import CheckpointStore, UnsupportedValueError
from ckptflow.storage.collector import collector_paused


@pytest.fixture(autouse=True)
def _collector_restored():
    enabled = gc.isenabled()
    yield
    (gc.enable if enabled else gc.disable)()


def test_a_save_and_a_load_run_with_the_collector_paused_and_restore_it(tmp_path, monkeypatch):
    seen: list[bool] = []
    import ckptflow.storage.save.saving as saving

    encode = saving.encode
    monkeypatch.setattr(saving, "encode", lambda state: (seen.append(gc.isenabled()), encode(state))[1])
    store = CheckpointStore(tmp_path / "store")
    gc.enable()
    store.save({"w": torch.ones(3)})
    assert seen == [False] and gc.isenabled()
    assert store.load()["w"].tolist() == [1.0] * 3 and gc.isenabled()
    with pytest.raises(UnsupportedValueError):
        store.save({"w": object()})
    assert gc.isenabled()  # a failed save restores it too


def test_a_collector_the_user_disabled_stays_disabled(tmp_path):
    store = CheckpointStore(tmp_path / "store")
    gc.disable()
    store.save({"w": torch.ones(3)})
    store.load()
    assert not gc.isenabled()


def test_overlapping_pauses_of_two_threads_end_with_the_last():
    gc.enable()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with collector_paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with collector_paused():
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's pause goes on
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_process_forked_during_a_pause_starts_with_the_collector_running():
    gc.enable()
    read, write = os.pipe()
    with collector_paused():
        pid = os.fork()
        if pid == 0:  # the child: a data loader's worker, say
            try:
                with collector_paused():
                    pass
                os.write(write, b"1" if gc.isenabled() else b"0")
            finally:
                os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    assert os.waitpid(pid, 0)[1] == 0
    assert gc.isenabled()
