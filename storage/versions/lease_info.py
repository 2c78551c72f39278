"""What a store's lease object holds, and whether the process holding it still lives.

A lease names its holder (owner, host, pid, start time, pid space), when it started and was
last renewed, its timeout and a random token. The lease file is untrusted input: bytes that
are not a lease, and fields out of their range (a time or timeout that is not finite, a pid no
kernel gives, text longer than a lease holds), read as None, and such a lease is treated as
stale. A holder is gone when its timeout passed without renewal, or at once when it was a
process of this host and pid space that no longer runs (see files.processes).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from ..files.processes import has_ended


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
    start: str = ""  # the holder's start time and pid space (files.processes); "" from older writers
    space: str = ""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes) -> LeaseInfo | None:
        """The lease in ``data``, or None for bytes that are not one (treated as stale)."""
        if len(data) > MAX_LEASE_BYTES:
            return None
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict):
                return None
            info = cls(
                owner=_text(raw["owner"], 1024),
                host=_text(raw["host"], 255),
                pid=_whole(raw["pid"], 1, MAX_PID),
                started=_time(raw["started"]),
                renewed=_time(raw["renewed"]),
                timeout=_time(raw["timeout"]),
                token=_text(raw["token"], 128),
                start=_text(raw.get("start", ""), 1024),
                space=_text(raw.get("space", ""), 1024),
            )
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
        if not info.token or not 0 < info.timeout <= MAX_TIMEOUT:
            return None
        return info

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.renewed

    def holder_gone(self) -> bool:
        """Whether the holder has certainly ended: a process of this host and pid space that no
        longer runs (see files.processes)."""
        return has_ended(self.host, self.pid, self.start, self.space)

    def is_stale(self, now: float | None = None) -> bool:
        return self.age(now) > self.timeout or self.holder_gone()

    def describe(self) -> str:
        return (
            f"{self.owner} (host {self.host}, pid {self.pid}, since {_when(self.started)}, "
            f"last renewed {_when(self.renewed)}, {self.age():.0f}s ago)"
        )


MAX_LEASE_BYTES = 64 * 1024  # a lease is a few hundred bytes; more is not one (and is not read)
MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT
MAX_TIMEOUT = 7 * 24 * 3600.0  # seconds; a longer timeout would keep a dead writer's lease for weeks
_LATEST_TIME = float(1 << 33)  # seconds since the epoch: the year 2242


def _text(value: object, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError("not a short text")
    return value


def _whole(value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError("not a whole number in range")
    return value


def _time(value: object) -> float:
    """Seconds: a finite, non-negative number (a time since the epoch, or a timeout)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("not a number")
    number = float(value)
    if not 0 <= number < _LATEST_TIME:  # False for NaN as well
        raise ValueError("not a time")
    return number


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def default_owner() -> str:
    """A description of this process for the lease: its command line, shortened."""
    argv = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv)) or "python"
    return argv if len(argv) <= 120 else argv[:117] + "..."
