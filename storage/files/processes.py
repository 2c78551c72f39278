"""Which process holds a lease or a claim, recorded so that another process can tell it has ended.

A pid names a process only within one boot and one pid namespace: another
container on the same host (with the same host name, as with host networking)
or the host after a reboot runs other processes under the same numbers, and a
pid is given out again once its process ends. So a holder is recorded with its
host name, its pid, its start time (field 22 of ``/proc/PID/stat``, clock
ticks after boot) and its space (the boot id and the pid namespace).

It has ended, for certain, only when it ran on this host in this space and no
process with its pid started at its start time (:func:`has_ended`). A record
of another space, or one without a space (written by an older ckptflow), is
never judged by its pid on Linux: it waits for its timeout; nor is one whose
entry ``/proc`` hides (``hidepid``). On a host without ``/proc`` (not Linux),
records carry no space, pids are the host's, and a live pid counts as the
holder (a pid reused by a later process keeps the lease until its timeout).
"""

from __future__ import annotations

import os
import socket


def start_ticks(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (the process's start time); None if there is no such process
    (or only a zombie, which runs no more). Raises OSError when ``/proc`` cannot tell: the process
    exists but its entry is hidden or unreadable (``hidepid``, another user's, another mount)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        if not pid_alive(pid):
            return None
        raise
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name in parentheses may hold spaces
    if fields and fields[0] in ("Z", "X"):  # a zombie has ended: only its exit status is left
        return None
    if len(fields) <= 19:
        raise OSError(f"/proc/{pid}/stat has no start time")
    return fields[19]


def ancestors(limit: int = 8) -> list[int]:
    """This process and up to ``limit`` of its ancestors, nearest first (as far as ``/proc`` tells)."""
    found, pid = [os.getpid()], os.getppid()
    while pid > 1 and len(found) <= limit:
        found.append(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            pid = int(stat[stat.rfind(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def pid_space() -> str | None:
    """This process's boot id and pid namespace: the scope in which its pids name processes; None
    where ``/proc`` cannot tell."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def this_process() -> tuple[str, int, str, str]:
    """(host, pid, start, space) of this process, to record in a lease or a claim; start and space
    are both "" where ``/proc`` cannot tell them."""
    pid = os.getpid()
    try:
        start = start_ticks(pid)
    except OSError:
        start = None
    space = pid_space()
    if start is None or space is None:
        return socket.gethostname(), pid, "", ""
    return socket.gethostname(), pid, start, space


def is_this_space(host: str, space: str) -> bool:
    """Whether a holder of ``host`` and ``space`` is named by pids as this process sees them."""
    return host == socket.gethostname() and space == (pid_space() or "")


def has_ended(host: str, pid: int, start: str, space: str) -> bool:
    """Whether the holder (host, pid, start, space) has certainly ended. False whenever this process
    cannot tell: another host or space, a record without a space where this host has ``/proc``
    (an older writer's, or one from another container), an entry ``/proc`` hides."""
    if host != socket.gethostname():
        return False
    here = pid_space()
    if not space or not start:
        return here is None and not space and not pid_alive(pid)  # hosts without /proc: pids are the host's
    if space != here:
        return False
    try:
        return start_ticks(pid) != start  # no such process (None), or a later one under the same pid
    except OSError:
        return False


def is_running(host: str, pid: int, start: str, space: str) -> bool:
    """Whether the holder is certainly running: a process of this host and pid space that started
    when the record says (False whenever this process cannot tell)."""
    if not start or not is_this_space(host, space):
        return False
    try:
        return start_ticks(pid) == start
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
