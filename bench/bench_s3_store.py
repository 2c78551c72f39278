"""Saving straight to S3: CheckpointStore("s3://...") against DCP's fsspec writer/reader and boto3.

Starts SeaweedFS (a real S3 server; ``--server moto`` for the mock) on free
127.0.0.1 ports, and times, in one run, the save and the load of one state of
``--size-mib`` (default 1024) float32 tensors of 64 MiB each:

- ckptflow: ``CheckpointStore("s3://bench/ckptflow").save(state, epoch=1)``
  and ``.load(into=state)``, through fsspec (s3fs), nothing staged on a local disk;
- DCP: ``dcp.save(state, storage_writer=FsspecWriter(url))`` and
  ``dcp.load(state, storage_reader=FsspecReader(url))`` (torch's own fsspec
  backend, its default settings);
- boto3, the network's limit: ``upload_file`` of the ``torch.save`` file of the
  state, ``download_file`` of it; the transfer only is timed (and its peak
  RSS includes ``torch.save``'s).

Each method runs in a fresh process; its peak RSS (``VmHWM``, reset once the
state is built) is given above the RSS at that point, as a fraction of the
state's size. A run's remote objects are deleted before the
next. The server shares the cores with the client.

Run: ``.venv/bin/python bench/bench_s3_store.py [--size-mib 1024] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file or with -m

from bench.bench_transfer import s3_client, s3_server, storage_options
from bench.common import MiB, emit, machine, markdown_table

BUCKET = "bench"
METHODS = ("ckptflow", "DCP FsspecWriter/Reader", "boto3 upload_file/download_file")


def make_state(size: int) -> dict:
    import torch

    numel = 64 * MiB // 4
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.rand(numel, generator=gen) for i in range(max(1, size // (64 * MiB)))}


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))


def rss_kib() -> int:
    return status_kib("VmRSS")


def child(method: str, direction: str, endpoint: str, size: int, work: str) -> dict:
    """One save or load in this process: its seconds and its peak RSS above the built state."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from ckptflow.storage import CheckpointStore

    state = make_state(size)
    if direction == "load":  # the load fills a state of the same shapes (its pages touched)
        for t in state.values():
            t.zero_()
    so = storage_options(endpoint)
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM, the peak RSS, starts again from here
        f.write("5")
    before = rss_kib()
    start = time.perf_counter()
    if method == "ckptflow":
        store = CheckpointStore(f"s3://{BUCKET}/ckptflow", storage_options=so)
        if direction == "save":
            store.save(state, epoch=1, version=1)
        else:
            loaded = store.load(1, into=state)  # in place, as DCP loads
            assert loaded.keys() == state.keys()
    elif method.startswith("DCP"):
        url = f"s3://{BUCKET}/dcp"
        if direction == "save":
            dcp.save(state, storage_writer=FsspecWriter(url, **so), no_dist=True)
        else:
            dcp.load(state, storage_reader=FsspecReader(url, **so), no_dist=True)
    else:
        client = s3_client(endpoint)
        # the network's limit: the file's bytes only (torch.save before, torch.load after, untimed)
        local = os.path.join(work, "state.pt")
        if direction == "save":
            torch.save(state, local)
            start = time.perf_counter()
            client.upload_file(local, BUCKET, "torch/state.pt")
            seconds = time.perf_counter() - start
        else:
            client.download_file(BUCKET, "torch/state.pt", local)
            seconds = time.perf_counter() - start
            assert torch.load(local, weights_only=True).keys() == state.keys()
        os.unlink(local)
    if not method.startswith("boto3"):
        seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    return {"seconds": seconds, "extra_rss": max(0, peak - before) * 1024}


def run_child(method: str, direction: str, endpoint: str, size: int, work: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps([method, direction, endpoint, size, work])],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def clean(endpoint: str) -> None:
    client = s3_client(endpoint)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--server", choices=["seaweedfs", "moto"], default="seaweedfs")
    p.add_argument("--markdown-out", type=Path, default=None)
    p.add_argument("--only", action="append", default=None, help="a method to run (repeatable)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return 0
    size = args.size_mib * MiB
    results: dict[tuple[str, str], list[dict]] = {(m, d): [] for m in METHODS for d in ("save", "load")}
    with s3_server(args.server) as (_, endpoint), tempfile.TemporaryDirectory(prefix="ckptflow-") as work:
        s3_client(endpoint).create_bucket(Bucket=BUCKET)
        for rep in range(args.repeats):
            methods = tuple(m for m in METHODS if not args.only or m in args.only)
            order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
            for method in order:
                for direction in ("save", "load"):
                    r = run_child(method, direction, endpoint, size, work)
                    results[(method, direction)].append(r)
                    print(
                        f"[{rep + 1}/{args.repeats}] {method} {direction}: {r['seconds']:.2f} s",
                        file=sys.stderr,
                    )
            clean(endpoint)
    rows = []
    results = {k: v for k, v in results.items() if v}
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in results.items()}
    for (method, direction), runs in results.items():
        rss = statistics.median(r["extra_rss"] for r in runs) / size
        mine = med[(method, direction)]
        ratios = [
            f"{med[(a, direction)] / mine:.2f}x" if (a, direction) in med else "n/a" for a in METHODS[1:]
        ]
        rows.append([direction, method, f"{mine:.2f}", f"{size / mine / 1e6:.0f}", f"{rss:.2f}x", *ratios])
    rows.sort(key=lambda r: (r[0] != "save",))
    header = ["", "method", "seconds", "MB/s", "peak RSS above the state", "vs DCP", "vs boto3"]
    report = "\n".join(
        [
            f"A {size / MiB:.0f} MiB state saved to and loaded from a local {args.server} S3 server; "
            f"median of {args.repeats}, each in a fresh process.",
            "",
            markdown_table(header, "llrrrrr", rows),
            "",
            f"Machine: {machine()}, Python {platform.python_version()}; the server shares these cores.",
        ]
    )
    emit(report, args.markdown_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
