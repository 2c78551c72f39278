"""Whether the process a lease or a claim names has ended: real processes, killed, reaped and reused.

A holder has ended only on proof: of this host and pid space, and no process of its pid started at
its start time. Everything this process cannot tell (another host or space, a record without a
space, an entry ``/proc`` hides) counts as alive, so that a live writer's lease is never taken.
"""

from __future__ import annotations

import builtins
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptflow.storage.files import processes
from ckptflow.storage.files.processes import has_ended, start_ticks, this_process


def test_this_process_has_not_ended_and_records_its_space():
    host, pid, start, space = this_process()
    assert (host, pid) == (socket.gethostname(), os.getpid()) and start and space
    assert not has_ended(host, pid, start, space)


def test_a_killed_process_has_ended_once_a_zombie_and_once_reaped():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = (socket.gethostname(), proc.pid, start_ticks(proc.pid) or "", this_process()[3])
        assert not has_ended(*record)
        proc.kill()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z":
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.01)
        assert has_ended(*record)  # not reaped yet: a zombie runs no more
    finally:
        proc.kill()
        proc.wait()
    assert has_ended(*record)  # reaped: no such pid


def test_a_pid_given_to_a_later_process_is_told_apart_by_its_start():
    host, pid, start, space = this_process()
    assert has_ended(host, pid, str(int(start) - 1), space)


def test_what_this_process_cannot_tell_counts_as_alive():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, _, _, space = this_process()
    assert has_ended(host, dead.pid, "1", space)
    assert not has_ended("elsewhere", dead.pid, "1", space)  # another host
    assert not has_ended(host, dead.pid, "1", "another-boot/pid:[1]")  # another container or boot
    assert not has_ended(host, dead.pid, "", "")  # an older writer's record: no space
    assert not has_ended(host, dead.pid, "", space)  # a space without a start


def test_an_entry_proc_hides_counts_as_alive(monkeypatch: pytest.MonkeyPatch):
    """``hidepid`` or a /proc of another namespace: the process exists (``kill(pid, 0)`` says so) but
    its stat cannot be read. Bug fixed: an unreadable entry read as "no such process"."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = (socket.gethostname(), proc.pid, start_ticks(proc.pid) or "", this_process()[3])
        real_open = builtins.open

        def hidden(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            if str(path) == f"/proc/{proc.pid}/stat":
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", hidden)
        with pytest.raises(OSError):
            start_ticks(proc.pid)
        assert not has_ended(*record)
        assert not has_ended(record[0], record[1], "1", record[3])  # even with another start
    finally:
        proc.kill()
        proc.wait()


def test_a_host_that_cannot_tell_its_own_space_judges_no_record_with_one(monkeypatch: pytest.MonkeyPatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    space = this_process()[3]
    monkeypatch.setattr(processes, "pid_space", lambda: None)  # e.g. no /proc here
    assert not has_ended(socket.gethostname(), dead.pid, "1", space)
    assert has_ended(socket.gethostname(), dead.pid, "", "")  # its own kind of record: pids are the host's
