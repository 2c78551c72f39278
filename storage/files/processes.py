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
never judged by its pid on Linux: it waits for its timeout. Without ``/proc``
(not Linux) pids are the host's, and a live pid counts as the holder.
"""

from __future__ import annotations

import functools
import os
import socket


def start_ticks(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (the process's start time); None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name in parentheses may hold spaces
    if len(fields) <= 19 or fields[0] in ("Z", "X"):  # a zombie has ended: only its exit status is left
        return None
    return fields[19]


@functools.lru_cache(maxsize=1)
def pid_space() -> str | None:
    """This process's boot id and pid namespace: the scope in which its pids name processes; None
    without ``/proc``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def this_process() -> tuple[str, int, str, str]:
    """(host, pid, start, space) of this process, to record in a lease or a claim ("" where unknown)."""
    pid = os.getpid()
    return socket.gethostname(), pid, start_ticks(pid) or "", pid_space() or ""


def is_this_space(host: str, space: str) -> bool:
    """Whether a holder of ``host`` and ``space`` is named by pids as this process sees them."""
    return host == socket.gethostname() and space == (pid_space() or "")


def has_ended(host: str, pid: int, start: str, space: str) -> bool:
    """Whether the holder (host, pid, start, space) has certainly ended (False when this process
    cannot tell: another host or space, or a record without one)."""
    if host != socket.gethostname():
        return False
    if pid_space() is None:  # no /proc: one pid space per host
        return not pid_alive(pid)
    if not space or space != pid_space():
        return False
    return start_ticks(pid) != start  # no such process (None), or a later one under the same pid


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (for hosts without ``/proc``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
