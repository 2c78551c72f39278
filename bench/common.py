"""What the benchmark scripts share: a disk to write on, fsync, timing, the machine line, the table.

Every script in bench/ prints one markdown table whose numbers come from one
run, under the same fairness rules: writes end with an fsync, files go to a
real disk (never tmpfs, which would measure memory), and the report names the
machine and its load. The scripts run both as ``python bench/bench_x.py`` and
``python -m bench.bench_x`` (from the repository root): each puts the root on
``sys.path`` before it imports this module. Only the standard library here, so
importing it costs nothing a benchmark would see.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

MiB = 1 << 20
DROP_CACHES = "/proc/sys/vm/drop_caches"

# -- files and disks ---------------------------------------------------------------------------------


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (Linux opens both read-only for it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache() -> None:
    """Flush dirty pages, then drop the page cache (needs write access to DROP_CACHES: root)."""
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3")


def mount_of(path: Path) -> tuple[str, str, str]:
    """(device, fs type, mount point) of the filesystem holding ``path``."""
    real = os.path.realpath(path)
    best = ("?", "?", "/")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[2]):
                best = (dev, fstype, mnt)
    return best


def disk_temp_dir() -> Path:
    """A temp directory on a real disk (not tmpfs)."""
    for cand in (tempfile.gettempdir(), "/var/tmp", os.getcwd()):
        if os.path.isdir(cand) and mount_of(Path(cand))[1] not in ("tmpfs", "ramfs"):
            return Path(cand)
    raise SystemExit("no disk-backed temp directory found; pass --dir")


# -- timing ------------------------------------------------------------------------------------------


def seconds(fn: Callable[..., object], *args: Any) -> float:
    """Wall-clock seconds of one call ``fn(*args)``."""
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of ``repeats`` calls of ``fn``."""
    return statistics.median(seconds(fn) for _ in range(repeats))


# -- the report --------------------------------------------------------------------------------------


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, e.g. ``"0.52, 0.61, 0.70"``."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> str:
    """Cores and CPU model, RAM, kernel: ``2 cores (AMD EPYC ...), 7.8 GiB RAM, Linux 6.1``."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    mem = next(int(ln.split()[1]) for ln in meminfo if ln.startswith("MemTotal")) / MiB  # kB -> GiB
    return f"{os.cpu_count()} cores ({cpu}), {mem:.1f} GiB RAM, Linux {platform.release()}"


def markdown_table(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> str:
    """A markdown table; ``align`` has a letter per column, ``l`` (left) or ``r`` (right)."""
    rule = ["---:" if a == "r" else "---" for a in align]
    lines: list[Sequence[object]] = [header, rule, *rows]
    if any(len(line) != len(align) for line in lines):
        raise ValueError(f"every row needs {len(align)} cells, as many as align={align!r} has letters")
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines)


def emit(report: str, markdown_out: Path | None) -> None:
    """Print the report, and write it to ``markdown_out`` too when given."""
    print(report)
    if markdown_out:
        markdown_out.write_text(report + "\n")
