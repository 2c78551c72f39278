"""What a store's lease object holds, and whether the process holding it still lives.

A lease names its holder (owner, host, pid, start time, pid space), when it started and was last renewed, its
timeout and a random token. Bytes that are not a lease read as None, and such a lease is
treated as stale. A holder is gone when its timeout passed without renewal, or at once
when it was a process of this host and pid space that no longer runs (see files.processes).
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
                start=str(raw.get("start", "")),
                space=str(raw.get("space", "")),
            )
        except (ValueError, KeyError, TypeError):
            return None

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


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def default_owner() -> str:
    """A description of this process for the lease: its command line, shortened."""
    argv = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv)) or "python"
    return argv if len(argv) <= 120 else argv[:117] + "..."
