"""What a store's lease object holds, and whether the process holding it still lives.

A lease names its holder (owner, host, pid), when it started and was last renewed, its
timeout and a random token. Bytes that are not a lease read as None, and such a lease is
treated as stale. A holder is gone when its timeout passed without renewal, or at once
when it was a process of this host that no longer exists.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone


@dataclass(frozen=True)
class LeaseInfo:
    """What the lease object holds."""

    owner: str
    host: str
    pid: int
    started: float  # seconds since the epoch, holder's clock
    renewed: float
    timeout: float
    token: str

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes) -> LeaseInfo | None:
        """The lease in ``data``, or None for bytes that are not one (treated as stale)."""
        try:
            raw = json.loads(data)
            return cls(
                owner=str(raw["owner"]),
                host=str(raw["host"]),
                pid=int(raw["pid"]),
                started=float(raw["started"]),
                renewed=float(raw["renewed"]),
                timeout=float(raw["timeout"]),
                token=str(raw["token"]),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.renewed

    def holder_gone(self) -> bool:
        """Whether the holder is a process of this host that no longer exists."""
        return self.host == socket.gethostname() and not pid_alive(self.pid)

    def is_stale(self, now: float | None = None) -> bool:
        return self.age(now) > self.timeout or self.holder_gone()

    def describe(self) -> str:
        return (
            f"{self.owner} (host {self.host}, pid {self.pid}, since {_when(self.started)}, "
            f"last renewed {_when(self.renewed)}, {self.age():.0f}s ago)"
        )


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def default_owner() -> str:
    """A description of this process for the lease: its command line, shortened."""
    argv = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv)) or "python"
    return argv if len(argv) <= 120 else argv[:117] + "..."
