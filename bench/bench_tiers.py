"""Two tiers: a fast local store drained to a durable S3 tier, against local-only and straight-to-S3.

Starts SeaweedFS (a real S3 server) on free 127.0.0.1 ports and measures, in one run, medians of
``--repeats``:

- **the loop's blocked time per save**: a transformer + AdamW (bench_steps' shape, 217 MiB)
  trains ``--steps`` steps and saves every ``--every`` steps with ``save_async`` into
  (a) a local store only; (b) a local store whose committed versions a background thread mirrors
  to S3, as a run's ``--upload-to`` does (the flow's upload tasks run in threads beside training);
  (c) a store straight on S3. "blocked" is the time the ``save_async`` call holds the loop
  (staging, and waiting for the previous save when it has not committed); "loop per save" is
  the loop's extra time per save against the same loop without saves (contention included);
- **commit to durable**: for (b), seconds from a version's commit to its manifest on S3;
- **restore**: the newest version read back from the fast tier (``load``); onto an empty
  machine from the durable tier (``fetch_newest`` into an empty directory, then ``load``);
  and a plain boto3 ``download_file`` of the same files (the bytes that version needs);
- **a frozen-base fine-tune** (122.6 MiB, 3.8 MiB changing per save): bytes that go up to the
  durable tier per version after the first, against the bytes that changed.

Run: ``.venv/bin/python bench/bench_tiers.py [--repeats 3] [--steps 60] [--every 10]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file or with -m

import torch

from bench.bench_steps import shapes, state_of
from bench.bench_transfer import s3_client, s3_server, storage_options
from bench.common import MiB, disk_temp_dir, load_average, machine, markdown_table
from ckptflow.storage import CheckpointStore, upload_storage_options

BUCKET = "bench"
WAYS = ("local only", "local + drain to S3", "straight to S3")


class Drain:
    """A thread that mirrors each committed version to the durable tier, in commit order."""

    def __init__(self, store: CheckpointStore, url: str, options: dict[str, Any]) -> None:
        self.store, self.url, self.options = store, url, options
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.lags: list[float] = []
        self.lock = threading.Lock()

    def committed(self, version: int) -> None:
        at = time.perf_counter()

        def job() -> None:
            self.store.mirror_version(version, self.url, storage_options=self.options)
            with self.lock:
                self.lags.append(time.perf_counter() - at)

        self.pool.submit(job)

    def end(self) -> None:
        self.pool.shutdown(wait=True)


def training_loop(way: str, root: Path, endpoint: str, steps: int, every: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, opt, loss_of = shapes()["transformer + AdamW"]()
    options = storage_options(endpoint)
    prefix = f"run-{time.monotonic_ns()}"
    url = f"s3://{BUCKET}/{prefix}"
    if way == "straight to S3":
        store = CheckpointStore(url, storage_options=options)
    else:
        store = CheckpointStore(root / prefix)
    drain = Drain(store, url, upload_storage_options(url, options)) if way == "local + drain to S3" else None
    blocked: list[float] = []
    pending = None
    started = time.perf_counter()
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        loss_of().backward()
        opt.step()
        if every and step % every == 0:
            t = time.perf_counter()
            pending = store.save_async(state_of(model, opt), epoch=step)
            blocked.append(time.perf_counter() - t)
            if drain is not None:  # as the flow's upload queue: told at the commit
                pending.on_commit(lambda info: drain.committed(info.version))
    if pending is not None:
        pending.wait()
    loop_seconds = time.perf_counter() - started
    if drain is not None:
        drain.end()
    store.close()
    return {"loop": loop_seconds, "blocked": blocked, "lags": drain.lags if drain else [], "url": url,
            "local": root / prefix}  # fmt: skip


def restore_times(local: Path, url: str, endpoint: str, work: Path) -> dict[str, float]:
    """The newest version read from the fast tier; fetched onto an empty machine and read; and a
    plain download of the same files."""
    options = storage_options(endpoint)
    fast = CheckpointStore(local)
    newest = fast.latest()
    assert newest is not None
    os.sync()
    t = time.perf_counter()
    fast.load()
    from_fast = time.perf_counter() - t
    empty = work / f"empty-{time.monotonic_ns()}"
    t = time.perf_counter()
    got = CheckpointStore(empty).fetch_newest(url, storage_options=upload_storage_options(url, options))
    fetched = time.perf_counter() - t
    assert got is not None and got.version == newest.version
    CheckpointStore(empty).load()
    fetched_and_loaded = time.perf_counter() - t
    manifest = fast.manifest(newest.version)
    client, plain = s3_client(endpoint), work / f"plain-{time.monotonic_ns()}"
    plain.mkdir()
    prefix = url.split("/", 3)[3]
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=8) as pool:  # as the fetch: 8 files at once
        list(
            pool.map(
                lambda wn: client.download_file(BUCKET, f"{prefix}/{wn[0]}/{wn[1]}", str(plain / wn[1])),
                manifest.shard_files(),
            )
        )
    for path in plain.iterdir():  # durable, as the fetch's files are
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    download = time.perf_counter() - t
    shutil.rmtree(empty)
    shutil.rmtree(plain)
    return {"fast": from_fast, "fetch": fetched, "fetch+load": fetched_and_loaded, "download": download,
            "bytes": float(got.bytes)}  # fmt: skip


def fine_tune_bytes(root: Path, endpoint: str, saves: int = 6) -> tuple[float, float, float]:
    """bench_incremental's frozen-base fine-tune (GPT-2 small's layout at half width, LoRA and a
    head trained): (its MiB, the median bytes up per version after the first, the bytes that
    changed per save)."""
    from bench.bench_incremental import Run, tensors

    options = storage_options(endpoint)
    prefix = f"ft-{time.monotonic_ns()}"
    url = f"s3://{BUCKET}/{prefix}"
    store = CheckpointStore(root / prefix)
    client = s3_client(endpoint)

    def bucket_bytes() -> int:
        total = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            total += sum(o["Size"] for o in page.get("Contents", []))
        return total

    run = Run(0.5, frozen=True)
    ups, before, previous = [], 0, None
    changed: list[int] = []
    for step in range(saves):
        if step:
            run.step()
        state = run.state()
        now_tensors = {k: t.clone() for k, t in tensors(state).items()}
        if previous is not None:
            changed.append(sum(t.numel() * t.element_size() for k, t in now_tensors.items()
                               if k not in previous or not torch.equal(previous[k], t)))  # fmt: skip
        previous = now_tensors
        info = store.save(state)
        store.mirror_version(info.version, url, storage_options=upload_storage_options(url, options))
        now = bucket_bytes()
        if step:
            ups.append(now - before)
        before = now
    total = sum(t.numel() * t.element_size() for t in previous.values()) if previous else 0
    return total / MiB, statistics.median(ups), float(statistics.median(changed))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args(argv)
    loops: dict[str, list[dict[str, Any]]] = {w: [] for w in (*WAYS, "no saves")}
    restores: list[dict[str, float]] = []
    with s3_server("seaweedfs") as (_, endpoint), tempfile.TemporaryDirectory(dir=disk_temp_dir()) as work:
        root = Path(work)
        s3_client(endpoint).create_bucket(Bucket=BUCKET)
        for rep in range(args.repeats):
            order = (*WAYS, "no saves")
            order = order[rep % len(order) :] + order[: rep % len(order)]
            for way in order:
                every = 0 if way == "no saves" else args.every
                r = training_loop(way if every else "local only", root, endpoint, args.steps, every)
                loops[way].append(r)
                print(f"[{rep + 1}/{args.repeats}] {way}: loop {r['loop']:.2f}s", file=sys.stderr)
                if way == "local + drain to S3":
                    restores.append(restore_times(r["local"], r["url"], endpoint, root))
                if way != "no saves":
                    shutil.rmtree(r["local"], ignore_errors=True)
        size, up, changed = fine_tune_bytes(root, endpoint)
    saves = args.steps // args.every
    base = statistics.median(r["loop"] for r in loops["no saves"])
    blocked = {w: statistics.median(b for r in loops[w] for b in r["blocked"]) for w in WAYS}
    rows = []
    for way in WAYS:
        per_save = (statistics.median(r["loop"] for r in loops[way]) - base) / saves
        lags = [x for r in loops[way] for x in r["lags"]]
        rows.append([
            way, f"{blocked[way] * 1e3:.1f}", f"{blocked[way] / blocked['local only']:.2f}x",
            f"{per_save * 1e3:.0f}", f"{statistics.median(lags):.2f}" if lags else "",
        ])  # fmt: skip
    med = {k: statistics.median(r[k] for r in restores) for k in restores[0]}
    print(
        f"Two tiers, transformer + AdamW (217 MiB), {args.steps} steps, a save every {args.every}; "
        f"SeaweedFS on 127.0.0.1; medians of {args.repeats}. {machine()}, load {load_average()}.\n"
    )
    print(markdown_table(
        ["save into", "loop blocked per save (ms)", "vs local only", "loop's extra time per save (ms)",
         "commit to durable (s)"], "lrrrr", rows,
    ))  # fmt: skip
    print()
    print(markdown_table(
        ["restore the newest version", "seconds", "vs plain download"], "lrr",
        [
            ["from the fast tier (load)", f"{med['fast']:.2f}", ""],
            [f"fetch from the durable tier onto an empty disk ({med['bytes'] / MiB:.0f} MiB)",
             f"{med['fetch']:.2f}", f"{med['fetch'] / med['download']:.2f}x"],
            ["fetch, then load", f"{med['fetch+load']:.2f}", f"{med['fetch+load'] / med['download']:.2f}x"],
            ["boto3 download_file of the same files (8 at once) + fsync", f"{med['download']:.2f}", "1.00x"],
        ],
    ))  # fmt: skip
    print()
    print(
        f"Frozen-base fine-tune ({size:.1f} MiB): {up / MiB:.2f} MiB up per version after the first, "
        f"{up / changed:.2f}x the {changed / MiB:.2f} MiB that changed."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
