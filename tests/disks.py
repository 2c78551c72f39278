"""Small real disks for the tests: a tmpfs of a few hundred KiB fills up and fails writes with
ENOSPC, as a full disk does (mounting needs root; without it the test is skipped)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(mountpoint: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount``'s syntax: ``512k``, ``1m``) mounted at ``mountpoint``."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        if subprocess.run(["umount", str(mountpoint)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], check=True)


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def fill(mountpoint: Path, *, leave: int) -> Path:
    """A file that takes all the free space of ``mountpoint`` but ``leave`` bytes; returns it."""
    filler = mountpoint / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free_bytes(mountpoint) - leave))
    return filler


def files_under(root: Path) -> list[str]:
    """Every file and directory under ``root``, relative, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))
