"""Archive benchmark: consolidating files into one tarball, ckptflow against GNU tar, tarfile and the disk.

Writes ``--files`` files of ``--size-mib`` MiB (random bytes; default 10 x 100
MiB) and packs them into one tar with each method, fsync included, and prints
one markdown table: median seconds of R repeats, GB/s (file bytes / time) and
speed ratios against GNU tar ``-b 2048`` and against a plain copy (dd-style).

Methods:

- ``ckptflow``: ``write_tar`` (every member hashed and checked against its
  expected xxh3, the whole tar hashed) and ``write_index``;
- ``gnu-tar-b2048`` / ``gnu-tar``: ``tar -b 2048 -cf`` and ``tar -cf``, then an
  fsync of the tar (GNU tar has no fsync option);
- ``tarfile`` / ``tarfile-1mib``: Python's ``tarfile`` with its default copy
  buffer (16 KiB) and with ``copybufsize`` 1 MiB, then an fsync;
- ``dd``: a plain copy of the files, back to back, into one file with an 8 MiB
  buffer, then an fsync: what the disk takes for these bytes the usual way;
- ``dd-writeback``: the same with ``sync_file_range`` started every 32 MiB, as
  ckptflow does, so the disk writes while the copy runs.

Fairness: before each timed run the output is removed and dirty pages are
flushed (``os.sync``), outside the timing; the page cache is dropped
(``/proc/sys/vm/drop_caches``) when that is permitted, else the sources are
read once so every method reads them warm (the table says which). The order
of the methods rotates between repeats. ckptflow's hashing is part of its time;
the others hash nothing.

Run: ``.venv/bin/python bench/bench_archive.py [--files 10] [--size-mib 100] [--repeats 5] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file or with -m

from bench.common import (
    DROP_CACHES,
    MiB,
    disk_temp_dir,
    drop_page_cache,
    emit,
    fsync_path,
    machine,
    markdown_table,
    seconds,
)
from ckptflow.storage.archive.tarwriter import Member, start_writeback, write_index, write_tar
from ckptflow.storage.files.location import open_location
from ckptflow.storage.format.checksum import digest

TAR = "bench.tar"


def make_files(src: Path, count: int, size: int) -> list[Member]:
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20240611)
    members = []
    for i in range(count):
        path = src / f"shard-{i:02d}.bin"
        data = rng.bytes(size)
        path.write_bytes(data)
        members.append(Member(f"v{i:06d}/{path.name}", str(path), size, digest(data)))
    return members


def run_ckptflow(src: Path, out: Path, members: list[Member]) -> None:
    dst = open_location(str(out))
    write_index(dst, write_tar(open_location(str(src)), members, dst, TAR))


def run_gnu_tar(src: Path, out: Path, members: list[Member], blocking: int | None) -> None:
    names = [os.path.basename(m.source) for m in members]
    extra = ["-b", str(blocking)] if blocking else []
    subprocess.run(["tar", *extra, "-cf", str(out / TAR), "-C", str(src), *names], check=True)
    fsync_path(out / TAR)


def run_tarfile(src: Path, out: Path, members: list[Member], bufsize: int | None) -> None:
    with tarfile.open(out / TAR, "w", format=tarfile.PAX_FORMAT, copybufsize=bufsize) as tar:
        for m in members:
            tar.add(m.source, arcname=m.name)
    fsync_path(out / TAR)


def run_copy(src: Path, out: Path, members: list[Member], writeback: bool) -> None:
    buf = memoryview(bytearray(8 * MiB))
    fd = os.open(out / TAR, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pos = flushed = 0
    try:
        for m in members:
            with open(m.source, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    view = buf[:n]
                    while view:
                        view = view[os.write(fd, view) :]
                    pos += n
                    if writeback and pos - flushed >= 32 * MiB:
                        start_writeback(fd, flushed, pos - flushed)
                        flushed = pos
        os.fsync(fd)
    finally:
        os.close(fd)


METHODS: dict[str, Callable[[Path, Path, list[Member]], None]] = {
    "ckptflow": run_ckptflow,
    "gnu-tar-b2048": lambda s, o, m: run_gnu_tar(s, o, m, 2048),
    "gnu-tar": lambda s, o, m: run_gnu_tar(s, o, m, None),
    "tarfile": lambda s, o, m: run_tarfile(s, o, m, None),
    "tarfile-1mib": lambda s, o, m: run_tarfile(s, o, m, MiB),
    "dd": lambda s, o, m: run_copy(s, o, m, False),
    "dd-writeback": lambda s, o, m: run_copy(s, o, m, True),
}


def prepare(out: Path, members: list[Member], drop: bool) -> None:
    """Untimed: clear the output, flush dirty pages, drop or warm the page cache."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if drop:
        drop_page_cache()
    else:
        os.sync()
        for m in members:
            with open(m.source, "rb", buffering=0) as f:
                while f.read(64 * MiB):
                    pass


def can_drop_caches() -> bool:
    try:
        Path(DROP_CACHES).write_text("3\n")
        return True
    except OSError:
        return False


def measure(work: Path, members: list[Member], repeats: int, drop: bool) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    names = list(METHODS)
    for rep in range(repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            out = work / "out"
            prepare(out, members, drop)
            times[name].append(seconds(METHODS[name], work / "src", out, members))
            print(f"  {name:14s} {times[name][-1]:.3f} s", file=sys.stderr, flush=True)
    shutil.rmtree(work / "out", ignore_errors=True)
    return times


def report(times: dict[str, list[float]], total: int, args: argparse.Namespace, cache: str, load: str) -> str:
    med = {name: statistics.median(ts) for name, ts in times.items()}
    gnu, dd = med["gnu-tar-b2048"], med["dd"]
    rows = [
        [name, f"{t:.3f}", f"{total / t / 1e9:.2f}", f"{gnu / t:.2f}x", f"{dd / t:.2f}x"]
        for name, t in med.items()
    ]
    spread = ", ".join(f"{n} {min(ts):.3f}-{max(ts):.3f}" for n, ts in times.items())
    return "\n".join(
        [
            f"Archive: {args.files} files x {args.size_mib} MiB into one tar, fsync included; median of "
            f"{args.repeats} (page cache: {cache}; {machine()}, load {load})",
            "",
            markdown_table(["method", "median s", "GB/s", "vs GNU tar -b 2048", "vs dd"], "lrrrr", rows),
            "",
            f"Range of the repeats (s): {spread}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=10)
    p.add_argument("--size-mib", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir on a disk)")
    p.add_argument("--markdown-out", type=Path, default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    assert shutil.which("tar"), "GNU tar is needed"
    work = Path(tempfile.mkdtemp(prefix="ckptflow-bench-archive-", dir=args.dir or disk_temp_dir()))
    try:
        members = make_files(work / "src", args.files, args.size_mib * MiB)
        drop = can_drop_caches()
        cache = "dropped before each run" if drop else "warm (drop_caches not permitted)"
        before = os.getloadavg()[0]
        times = measure(work, members, args.repeats, drop)
        load = f"{before:.1f} before, {os.getloadavg()[0]:.1f} after"
        text = report(times, args.files * args.size_mib * MiB, args, cache, load)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(text, args.markdown_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
