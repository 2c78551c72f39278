"""Transfer benchmark: ckptflow's upload_file / download_file against boto3 and s3fs on a local S3 server.

Starts a real S3 server, SeaweedFS (``--server seaweedfs``, the default; the
``weed`` binary of the test extras), or moto's mock (``--server moto``), on
free ports of 127.0.0.1, writes a file of ``--size-mib`` random bytes (default
1 GiB), and measures in one run, with the methods interleaved in each repeat
(their order rotating from one repeat to the next):

- upload: ckptflow ``upload_file`` (boto3's transfer engine, default options:
  8 MiB parts, 10 in flight, the file's CRC32 checked by the server and by a
  HEAD after), boto3 ``upload_file`` (default TransferConfig), s3fs
  ``put_file``;
- download (of one object uploaded by ckptflow): ckptflow ``download_file``
  (CRC32 checked; and with the size check only), boto3 ``download_file``
  (default TransferConfig), s3fs ``get_file``.

Fairness: every download ends with the file fsynced (ckptflow's download does
it itself; the others get an ``os.fsync`` inside the timing), the remote copy
of an upload is deleted before the next repeat (so ckptflow cannot skip it),
and the local file is in the page cache for every upload. The server runs on
the same cores as the client: the table shows the median of the repeats, MB/s
(10^6 bytes/s), the client's and the server's CPU seconds, and the time ratio
against boto3 in its direction (>1: faster than boto3).

Run: ``.venv/bin/python bench/bench_transfer.py [--size-mib 1024] [--repeats 1] [--server seaweedfs|moto]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import fsspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file or with -m

from bench.common import MiB, emit, fsync_path, machine, markdown_table
from ckptflow.storage.remote.transfer import TransferOptions, download_file, upload_file

BUCKET = "bench"
KEY, SECRET = "bench-key", "bench-secret"
UP_ANCHOR, DOWN_ANCHOR = "boto3 upload_file (default)", "boto3 download_file (default)"


@dataclass
class Env:
    endpoint: str
    src: Path  # the local file to upload
    out: Path  # where downloads go
    client: Any  # boto3 S3 client
    storage_options: dict[str, Any]
    server_pid: int

    def s3fs(self):
        return fsspec.filesystem("s3", **self.storage_options)


# -- methods: each returns the bytes moved; setup/cleanup stay outside the timing ------------------


def up_ckptflow(env: Env) -> None:
    r = upload_file(env.src, f"s3://{BUCKET}/up-ckptflow", storage_options=env.storage_options)
    assert not r.skipped


def up_boto3(env: Env) -> None:
    env.client.upload_file(str(env.src), BUCKET, "up-boto3")


def up_s3fs(env: Env) -> None:
    env.s3fs().put_file(str(env.src), f"{BUCKET}/up-s3fs")


def down_ckptflow(env: Env) -> None:
    download_file(f"s3://{BUCKET}/src", env.out, storage_options=env.storage_options)


def down_ckptflow_size_only(env: Env) -> None:
    options = TransferOptions(download_checksums=False)
    download_file(f"s3://{BUCKET}/src", env.out, storage_options=env.storage_options, options=options)


def down_boto3(env: Env) -> None:
    env.client.download_file(BUCKET, "src", str(env.out))
    fsync_path(env.out)


def down_s3fs(env: Env) -> None:
    env.s3fs().get_file(f"{BUCKET}/src", str(env.out))
    fsync_path(env.out)


METHODS: dict[str, tuple[str, Callable[[Env], None]]] = {
    "ckptflow upload_file": ("upload", up_ckptflow),
    UP_ANCHOR: ("upload", up_boto3),
    "s3fs put_file": ("upload", up_s3fs),
    "ckptflow download_file": ("download", down_ckptflow),
    "ckptflow download_file (size check only)": ("download", down_ckptflow_size_only),
    DOWN_ANCHOR: ("download", down_boto3),
    "s3fs get_file": ("download", down_s3fs),
}


def cleanup(env: Env) -> None:
    for key in ("up-ckptflow", "up-boto3", "up-s3fs"):
        env.client.delete_object(Bucket=BUCKET, Key=key)
    env.out.unlink(missing_ok=True)


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the server has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(env: Env, fn: Callable[[Env], None]) -> tuple[float, float, float]:
    """Wall seconds, client CPU seconds, server CPU seconds of one call."""
    cleanup(env)
    os.sync()
    server, cpu, t0 = server_cpu(env.server_pid), time.process_time(), time.perf_counter()
    fn(env)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
    return wall, cpu, server_cpu(env.server_pid) - server


# -- the server and the fixture ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(kind: str) -> Iterator[tuple[int, str]]:
    """(pid, endpoint) of a fresh S3 server of ``kind`` ("seaweedfs" or "moto"), stopped at the end."""
    if kind == "moto":
        proc, endpoint = start_moto()
        try:
            yield proc.pid, endpoint
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        return
    from tests.seaweed import start_seaweed

    with tempfile.TemporaryDirectory(prefix="ckptflow-bench-weed-") as root:
        server = start_seaweed(Path(root))
        try:
            yield server.process.pid, server.endpoint
        finally:
            server.stop()


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return proc, url
        except urllib.error.HTTPError:
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def s3_client(endpoint: str) -> Any:
    """A boto3 client of the bench server, with the bench's keys."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )


def storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for the bench server."""
    return {
        "key": KEY,
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def make_env(endpoint: str, server_pid: int, work: Path, size: int) -> Env:
    src = work / "src.bin"
    with open(src, "wb") as f:
        for off in range(0, size, 64 * MiB):
            f.write(os.urandom(min(64 * MiB, size - off)))
    client = s3_client(endpoint)
    client.create_bucket(Bucket=BUCKET)
    options = storage_options(endpoint)
    env = Env(endpoint, src, work / "download.bin", client, options, server_pid)
    upload_file(src, f"s3://{BUCKET}/src", storage_options=options)  # the object every download reads
    return env


# -- report ----------------------------------------------------------------------------------------


def render(results: dict[str, list[tuple[float, float, float]]], size: int, args: argparse.Namespace) -> str:
    med = {name: statistics.median(r[0] for r in runs) for name, runs in results.items()}
    rows = []
    for name, runs in results.items():
        direction = METHODS[name][0]
        anchor = med.get(UP_ANCHOR if direction == "upload" else DOWN_ANCHOR)
        ratio = f"{anchor / med[name]:.2f}x" if anchor else "n/a"
        cpu = statistics.median(r[1] for r in runs)
        server = statistics.median(r[2] for r in runs)
        mbs = size / med[name] / 1e6
        rows.append([direction, name, f"{med[name]:.2f}", f"{mbs:.0f}", f"{cpu:.1f}", f"{server:.1f}", ratio])
    header = ["direction", "method", "seconds", "MB/s", "client CPU s", "server CPU s", "vs boto3"]
    return "\n".join(
        [
            f"Transfers of {size / MiB:.0f} MiB on a local {args.server} S3 server; "
            f"median of {args.repeats} repeat(s).",
            "",
            markdown_table(header, "llrrrrr", rows),
            "",
            f"Machine: {machine()}, Python {platform.python_version()}; "
            "the server shares these cores with the client. ckptflow options: "
            f"{TransferOptions()}.",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="file size in MiB (default 1024)")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats per method; the median is shown")
    p.add_argument(
        "--only", action="append", default=None, help="a method to run (repeatable): " + "; ".join(METHODS)
    )
    p.add_argument("--dir", type=Path, default=None, help="where the local files go (default: a temp dir)")
    p.add_argument("--server", choices=["seaweedfs", "moto"], default="seaweedfs", help="the S3 server")
    p.add_argument("--markdown-out", type=Path, default=None, help="also write the table to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.only or list(METHODS)
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods: {unknown}; choose from {list(METHODS)}")
    size = args.size_mib * MiB
    with (
        s3_server(args.server) as (pid, endpoint),
        tempfile.TemporaryDirectory(dir=args.dir, prefix="ckptflow-bench-xfer-") as work,
    ):
        env = make_env(endpoint, pid, Path(work), size)
        results: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
        for rep in range(args.repeats):
            # the order rotates each repeat: the first transfer of a round tends to be the slow one
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                seconds, cpu, server = measure(env, METHODS[name][1])
                results[name].append((seconds, cpu, server))
                print(f"[{rep + 1}/{args.repeats}] {name}: {seconds:.2f} s", file=sys.stderr, flush=True)
        cleanup(env)
    report = render(results, size, args)
    emit(report, args.markdown_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
