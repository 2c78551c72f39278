"""Storage benchmark: ckptflow against torch.save, DCP, safetensors, h5py and the disk itself.

Saves and loads a training state of ``--size-mib`` (default 1 GiB: a
transformer-ish fp32 model holding a third of the bytes, and its Adam state,
exp_avg and exp_avg_sq, holding the rest) with each method, and prints one
markdown table: median seconds of R repeats, GB/s, extra peak RSS, and time
ratios against the anchors.

Anchors: the disk's own limit (a plain write of the same bytes + fsync, a plain
``os.preadv`` into a preallocated buffer), torch.save / torch.load, h5py
``read_direct`` into existing arrays, and a memcpy of the state into
preallocated memory (what ``save_async`` must at least block for).

Fairness rules, which the numbers depend on:

- Every save ends with its files and their directory fsynced (DCP with
  ``sync_files=True``); dirty pages from earlier work are flushed (``os.sync``)
  before each timed save, outside the timing.
- Loads are warm by default: the files are read once before the timed repeats,
  so they come from the page cache and the table measures the software, not the
  disk. ``--cold`` drops the page cache before each timed load (needs root).
- Each method runs in its own subprocess, which builds the same state from a
  fixed seed and first runs the method once on a 1 MiB state (untimed), so lazy
  imports and thread pools stay out of the timings. glibc's mmap threshold is
  fixed (``MALLOC_MMAP_THRESHOLD_``), so fresh tensors pay their page faults in
  every repeat, as in the one load of a resumed run.
- Extra peak RSS: the kernel's high-water mark is reset (``5`` into
  ``/proc/self/clear_refs``) right before the timed call, and the row reports
  VmHWM at the end minus VmRSS at the start (max over the repeats). It counts
  file pages an mmap maps in, since they are resident too.

Run: ``.venv/bin/python bench/bench_storage.py [--size-mib 1024] [--repeats 3] [--only a,b] [--cold]``.
Where CUDA is present, ``gpu-load`` also loads onto the GPU (``--only gpu-load`` for just that: it
saves the files it loads), against ``torch.load(map_location="cuda")``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file or with -m

from bench.common import (
    DROP_CACHES,
    MiB,
    disk_temp_dir,
    drop_page_cache,
    emit,
    fsync_path,
    load_average,
    machine,
    markdown_table,
    mount_of,
)

READ_CHUNK = 64 * MiB
PAGE = os.sysconf("SC_PAGE_SIZE")
DONE = ".complete"  # marks a fixture directory whose save finished

# -- the state ---------------------------------------------------------------------------------------


def model_shapes(model_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter shapes of a small GPT-like model of about ``model_bytes`` fp32 bytes."""
    d = 1024
    while d > 64 and 2 * 12 * d * d * 4 > model_bytes:  # at least two layers
        d //= 2
    layer = [
        ("attn.qkv.weight", (3 * d, d)),
        ("attn.qkv.bias", (3 * d,)),
        ("attn.out.weight", (d, d)),
        ("attn.out.bias", (d,)),
        ("ln1.weight", (d,)),
        ("ln1.bias", (d,)),
        ("mlp.fc1.weight", (4 * d, d)),
        ("mlp.fc1.bias", (4 * d,)),
        ("mlp.fc2.weight", (d, 4 * d)),
        ("mlp.fc2.bias", (d,)),
        ("ln2.weight", (d,)),
        ("ln2.bias", (d,)),
    ]
    per_layer = 4 * sum(math.prod(s) for _, s in layer)
    layers = max(1, int(model_bytes * 0.85) // per_layer)
    vocab = max(1, (model_bytes - layers * per_layer - 2 * d * 4) // (4 * d))
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, d))]
    shapes += [(f"layers.{i}.{name}", shape) for i in range(layers) for name, shape in layer]
    return [*shapes, ("norm.weight", (d,)), ("norm.bias", (d,))]


def build_state(size_mib: int, seed: int = 0) -> dict[str, Any]:
    """Model parameters and an Adam ``state_dict()`` layout, filled from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    model = {name: torch.randn(shape, generator=g) for name, shape in model_shapes(size_mib * MiB // 3)}
    opt_state = {
        i: {
            "step": torch.tensor(1000.0),
            "exp_avg": torch.randn(p.shape, generator=g).mul_(1e-3),
            "exp_avg_sq": torch.rand(p.shape, generator=g).mul_(1e-6),
        }
        for i, p in enumerate(model.values())
    }
    group = {
        "lr": 3e-4,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.01,
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "params": list(range(len(model))),
    }
    return {"model": model, "optimizer": {"state": opt_state, "param_groups": [group]}}


def flat_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted key path, tensor) for every tensor in a nested dict/list state."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for k, v in enumerate(tree):
            yield from flat_tensors(v, f"{prefix}.{k}" if prefix else str(k))


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The key path where ``a`` and ``b`` differ (tensors compared bit for bit), or None."""
    if isinstance(a, torch.Tensor):
        ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        ok = ok and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        return None if ok else path or "<root>"
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return f"{path} (keys)"
        diffs = (first_difference(a[k], b[k], f"{path}/{k}") for k in a)
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path} (type or length)"
        diffs = (first_difference(x, y, f"{path}/{i}") for i, (x, y) in enumerate(zip(a, b, strict=True)))
    else:
        return None if type(a) is type(b) and a == b else path
    return next((d for d in diffs if d is not None), None)


def as_bytes(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data


def touch_pages(tree: Any) -> int:
    """Read one byte of every page of every tensor (faults in an mmap); returns a checksum-ish int."""
    return sum(int(t.reshape(-1).view(torch.uint8)[::PAGE].sum()) for _, t in flat_tensors(tree))


def preallocated_like(tree: Any) -> Any:
    """The same structure with every tensor replaced by a zeroed (so touched) tensor."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: preallocated_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [preallocated_like(v) for v in tree]
    return copy.deepcopy(tree)


# -- measuring ---------------------------------------------------------------------------------------


def status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


class Probe:
    """Seconds and extra peak RSS (MiB) since ``start``, recorded under a label at each ``mark``."""

    def start(self) -> Probe:
        gc.collect()
        reset_peak_rss()
        self.marks: dict[str, tuple[float, float]] = {}
        self.base = status_mib("VmRSS")
        self.t0 = time.perf_counter()
        return self

    def mark(self, label: str) -> None:
        elapsed = time.perf_counter() - self.t0
        self.marks[label] = (elapsed, status_mib("VmHWM") - self.base)


Samples = dict[str, list[tuple[float, float]]]


def repeat(n: int, once: Callable[[Probe], Any], before: Callable[[], object] | None = None) -> Samples:
    """Run ``once`` n times (``before`` untimed ahead of each) and gather its marks."""
    samples: Samples = {}
    for _ in range(n):
        if before is not None:
            before()
        probe = Probe().start()
        result = once(probe)
        for label, m in probe.marks.items():
            samples.setdefault(label, []).append(m)
        del result
    gc.collect()
    return samples


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    os.sync()  # flush earlier dirty pages so they are not billed to the next save
    return path


def prewarm(path: Path) -> None:
    """Read every file under ``path`` once, so a warm load finds it in the page cache."""
    buf = memoryview(bytearray(8 * MiB))
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)


# -- savers (also used to build the fixtures the loads read) ------------------------------------------


def write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def write_raw(tensors: list[torch.Tensor], file: Path) -> None:
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            write_all(fd, as_bytes(t))
        os.fsync(fd)
    finally:
        os.close(fd)


def save_raw(ctx: Ctx, path: Path) -> None:
    write_raw([t for _, t in ctx.tensors], path / "state.bin")
    fsync_path(path)


def save_raw_parallel(ctx: Ctx, path: Path) -> None:
    n = ctx.args.shards
    groups: list[list[torch.Tensor]] = [[] for _ in range(n)]
    sizes = [0] * n
    for _, t in sorted(ctx.tensors, key=lambda kv: -kv[1].nbytes):  # largest first, lightest bin
        i = sizes.index(min(sizes))
        groups[i].append(t)
        sizes[i] += t.nbytes
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda i: write_raw(groups[i], path / f"part-{i}.bin"), range(n)))
    fsync_path(path)


def save_ckptflow(ctx: Ctx, path: Path) -> None:
    from ckptflow.storage import CheckpointStore

    with CheckpointStore(str(path), options=ctx.store_options()) as store:
        store.save(ctx.state, epoch=0)


def save_torch(ctx: Ctx, path: Path) -> None:
    torch.save(ctx.state, path / "state.pt")
    fsync_path(path / "state.pt")
    fsync_path(path)


def save_dcp(ctx: Ctx, path: Path, threads: int = 1) -> None:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(path), thread_count=threads, sync_files=True)
    dcp.save(ctx.state, storage_writer=writer, no_dist=True)
    fsync_path(path)


def save_safetensors(ctx: Ctx, path: Path) -> None:
    from safetensors.torch import save_file

    meta = {"param_groups": json.dumps(ctx.state["optimizer"]["param_groups"])}
    save_file(dict(ctx.tensors), str(path / "state.safetensors"), metadata=meta)
    fsync_path(path / "state.safetensors")
    fsync_path(path)


def save_h5py(ctx: Ctx, path: Path) -> None:
    import h5py

    with h5py.File(path / "state.h5", "w") as f:
        for name, t in ctx.tensors:
            f.create_dataset(name, data=t.numpy())
        f.attrs["param_groups"] = json.dumps(ctx.state["optimizer"]["param_groups"])
    fsync_path(path / "state.h5")
    fsync_path(path)


SAVERS: dict[str, Callable[[Ctx, Path], None]] = {
    "raw": save_raw,
    "ckptflow": save_ckptflow,
    "torch": save_torch,
    "dcp": save_dcp,
    "safetensors": save_safetensors,
    "h5py": save_h5py,
}


# -- the worker: one method, in its own process ------------------------------------------------------


@dataclass
class Ctx:
    args: argparse.Namespace
    run_dir: Path
    state: dict[str, Any]
    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int

    def store_options(self):
        from ckptflow.storage import StoreOptions

        return StoreOptions(shards=self.args.shards, threads=self.args.threads)

    def fixture(self, fmt: str) -> Path:
        """The directory holding this state saved as ``fmt``; saved now (untimed) if missing."""
        path = self.run_dir / fmt
        if not (path / DONE).exists():
            SAVERS[fmt](self, fresh_dir(path))
            (path / DONE).touch()
        return path

    def load_loop(self, path: Path, once: Callable[[Probe], Any]) -> Samples:
        """Timed loads of files under ``path``: warm (read once first) or cold (cache dropped each time)."""
        if self.args.cold:
            return repeat(self.args.repeats, once, before=drop_page_cache)
        prewarm(path)
        return repeat(self.args.repeats, once)

    def save_loop(self, fmt: str, label: str, save: Callable[[Path], None]) -> Samples:
        """Timed saves into a fresh fixture directory; the last one stays as the fixture."""
        path = self.run_dir / fmt

        def once(p: Probe) -> None:
            save(path)
            p.mark(label)
            (path / DONE).touch()

        return repeat(self.args.repeats, once, before=lambda: fresh_dir(path))


def rows(ctx: Ctx, samples: Samples, nbytes: int | None = None) -> list[dict[str, Any]]:
    return [
        {
            "key": label,
            "nbytes": ctx.nbytes if nbytes is None else nbytes,
            "seconds": [s for s, _ in marks],
            "peak_mib": max(m for _, m in marks),
        }
        for label, marks in samples.items()
    ]


METHODS: dict[str, Callable[[Ctx], list[dict[str, Any]]]] = {}


def method(name: str):
    def register(fn):
        METHODS[name] = fn
        return fn

    return register


def copy_into(buf: torch.Tensor, tensors: list[tuple[str, torch.Tensor]]) -> None:
    offset = 0
    for _, t in tensors:
        n = t.nbytes
        buf[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)
        offset += (n + 63) // 64 * 64  # the staging buffer's alignment


@method("memcpy")
def _memcpy(ctx: Ctx) -> list[dict[str, Any]]:
    size = sum((t.nbytes + 63) // 64 * 64 for _, t in ctx.tensors)
    buf = torch.zeros(size, dtype=torch.uint8)  # allocated and touched beforehand

    def touched(p: Probe) -> None:
        copy_into(buf, ctx.tensors)
        p.mark("memcpy-touched")

    def fresh(p: Probe) -> torch.Tensor:
        out = torch.empty(size, dtype=torch.uint8)
        copy_into(out, ctx.tensors)
        p.mark("memcpy-fresh")
        return out

    return rows(ctx, repeat(ctx.args.repeats, touched)) + rows(ctx, repeat(ctx.args.repeats, fresh))


@method("raw-write")
def _raw_write(ctx: Ctx) -> list[dict[str, Any]]:
    one = ctx.save_loop("raw", "raw-write", lambda path: save_raw(ctx, path))
    par = ctx.save_loop("raw-par", "raw-write-par", lambda path: save_raw_parallel(ctx, path))
    shutil.rmtree(ctx.run_dir / "raw-par")
    return rows(ctx, one) + rows(ctx, par)


def read_file_into(file: Path, buf: torch.Tensor, threads: int) -> None:
    """Fill ``buf`` with the file's bytes: ``os.preadv`` of 64 MiB ranges by ``threads`` threads."""
    view = buf.numpy().data
    fd = os.open(file, os.O_RDONLY)

    def one(start: int) -> None:
        part, pos = view[start : start + READ_CHUNK], start
        while part:
            n = os.preadv(fd, [part], pos)
            if n == 0:
                raise EOFError(f"{file} ends at byte {pos}")
            part, pos = part[n:], pos + n

    try:
        starts = range(0, len(view), READ_CHUNK)
        if threads == 1:
            for s in starts:
                one(s)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, starts))
    finally:
        os.close(fd)


@method("raw-read")
def _raw_read(ctx: Ctx) -> list[dict[str, Any]]:
    path = ctx.fixture("raw")
    file, threads = path / "state.bin", ctx.args.threads
    buf = torch.zeros(ctx.nbytes, dtype=torch.uint8)  # allocated and touched beforehand

    def fresh(p: Probe) -> torch.Tensor:
        out = torch.empty(ctx.nbytes, dtype=torch.uint8)
        read_file_into(file, out, threads)
        p.mark("raw-read-fresh")
        return out

    def prealloc(label: str, n: int) -> Callable[[Probe], None]:
        def once(p: Probe) -> None:
            read_file_into(file, buf, n)
            p.mark(label)

        return once

    samples = ctx.load_loop(path, prealloc("raw-read", 1))
    samples |= ctx.load_loop(path, prealloc("raw-read-par", threads))
    samples |= ctx.load_loop(path, fresh)
    offset = 0
    for name, t in ctx.tensors:  # correctness guard, untimed
        if not torch.equal(buf[offset : offset + t.nbytes], t.reshape(-1).view(torch.uint8)):
            raise AssertionError(f"plain read returned other bytes than were written for {name}")
        offset += t.nbytes
    return rows(ctx, samples)


@method("ckptflow-save")
def _ckptflow_save(ctx: Ctx) -> list[dict[str, Any]]:
    return rows(ctx, ctx.save_loop("ckptflow", "ckpt-save", lambda path: save_ckptflow(ctx, path)))


@method("ckptflow-save-async-first")
def _ckptflow_save_async_first(ctx: Ctx) -> list[dict[str, Any]]:
    """The first ``save_async`` of a fresh process (it allocates the staging buffer): one sample
    per worker process; ``main`` runs this method in ``--first-samples`` fresh processes."""
    from ckptflow.storage import CheckpointStore

    store = CheckpointStore(str(fresh_dir(ctx.run_dir / "ckptflow-async-first")), options=ctx.store_options())

    def once(p: Probe) -> None:
        handle = store.save_async(ctx.state, epoch=0)
        p.mark("ckpt-async-block-first")
        handle.wait()

    samples = repeat(1, once)
    store.close()
    shutil.rmtree(ctx.run_dir / "ckptflow-async-first")
    return rows(ctx, samples)


@method("ckptflow-save-async")
def _ckptflow_save_async(ctx: Ctx) -> list[dict[str, Any]]:
    """One store, R+1 saves: the first (untimed: ``ckptflow-save-async-first`` measures it in
    fresh processes) allocates the staging buffer, the others reuse it."""
    from ckptflow.storage import CheckpointStore

    store = CheckpointStore(str(fresh_dir(ctx.run_dir / "ckptflow-async")), options=ctx.store_options())
    calls = iter(range(ctx.args.repeats + 1))

    def once(p: Probe) -> None:
        i = next(calls)
        handle = store.save_async(ctx.state, epoch=i)
        if i:
            p.mark("ckpt-async-block")
        handle.wait()
        if i:
            p.mark("ckpt-async-total")

    def between() -> None:
        store.prune(keep_last=1)
        os.sync()

    samples = repeat(ctx.args.repeats + 1, once, before=between)
    store.close()
    shutil.rmtree(ctx.run_dir / "ckptflow-async")
    return rows(ctx, samples)


@method("ckptflow-load")
def _ckptflow_load(ctx: Ctx) -> list[dict[str, Any]]:
    from ckptflow.storage import CheckpointStore

    path = ctx.fixture("ckptflow")
    store = CheckpointStore(str(path), options=ctx.store_options())
    checked: set[str] = set()

    def once(label: str, expected: Any, **kwargs: Any) -> Callable[[Probe], Any]:
        def run(p: Probe) -> Any:
            out = store.load(**kwargs)
            p.mark(label)
            if label not in checked:  # correctness guard, once per variant, untimed
                diff = first_difference(expected, out)
                if diff is not None:
                    raise AssertionError(f"ckptflow {label} differs from the saved state at {diff}")
                checked.add(label)
            return out

        return run

    full = ctx.load_loop(path, once("ckpt-load", ctx.state))
    full |= ctx.load_loop(path, once("ckpt-load-noverify", ctx.state, verify=False))
    target = preallocated_like(ctx.state)  # a resumed run's freshly built model and optimizer
    full |= ctx.load_loop(path, once("ckpt-load-into", ctx.state, into=target))
    model = ctx.load_loop(path, once("ckpt-load-model", {"model": ctx.state["model"]}, keys=["model"]))
    model_bytes = sum(t.nbytes for _, t in flat_tensors(ctx.state["model"]))

    def verify(p: Probe) -> None:  # every byte against every shard and blob checksum, no tensors built
        store.verify()
        p.mark("ckpt-verify")

    checked_only = ctx.load_loop(path, verify)
    return rows(ctx, full) + rows(ctx, model, model_bytes) + rows(ctx, checked_only)


@method("torch-save")
def _torch_save(ctx: Ctx) -> list[dict[str, Any]]:
    return rows(ctx, ctx.save_loop("torch", "torch-save", lambda path: save_torch(ctx, path)))


@method("torch-load")
def _torch_load(ctx: Ctx) -> list[dict[str, Any]]:
    path = ctx.fixture("torch")
    file = path / "state.pt"

    def mmap(p: Probe) -> Any:
        out = torch.load(file, weights_only=True, mmap=True)
        p.mark("torch-load-mmap")
        touch_pages(out)
        p.mark("torch-load-mmap-touched")
        cloned = {k: v.clone() for k, v in flat_tensors(out)}
        p.mark("torch-load-mmap-clone")
        return cloned

    def plain(p: Probe) -> Any:
        out = torch.load(file, weights_only=True)
        p.mark("torch-load")
        return out

    return rows(ctx, ctx.load_loop(path, plain) | ctx.load_loop(path, mmap))


@method("dcp-save")
def _dcp_save(ctx: Ctx) -> list[dict[str, Any]]:
    samples: Samples = {}
    for threads in (1, 2):
        save = lambda path, threads=threads: save_dcp(ctx, path, threads)  # noqa: E731
        samples |= ctx.save_loop("dcp", f"dcp-save-t{threads}", save)
    return rows(ctx, samples)


@method("dcp-load")
def _dcp_load(ctx: Ctx) -> list[dict[str, Any]]:
    import torch.distributed.checkpoint as dcp

    path = ctx.fixture("dcp")
    target = preallocated_like(ctx.state)  # allocated and touched beforehand

    def once(p: Probe) -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
        p.mark("dcp-load")

    return rows(ctx, ctx.load_loop(path, once))


@method("safetensors-save")
def _safetensors_save(ctx: Ctx) -> list[dict[str, Any]]:
    return rows(ctx, ctx.save_loop("safetensors", "st-save", lambda path: save_safetensors(ctx, path)))


@method("safetensors-load")
def _safetensors_load(ctx: Ctx) -> list[dict[str, Any]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = ctx.fixture("safetensors")
    file = str(path / "state.safetensors")

    def mmap(p: Probe) -> Any:
        out = load_file(file)
        with safe_open(file, framework="pt") as f:
            json.loads(f.metadata()["param_groups"])
        p.mark("st-load-mmap")
        touch_pages(out)
        p.mark("st-load-mmap-touched")
        return out

    def pread(p: Probe) -> Any:
        out = load_file(file, backend="pread")
        p.mark("st-load-pread")
        return out

    return rows(ctx, ctx.load_loop(path, mmap) | ctx.load_loop(path, pread))


@method("h5py-save")
def _h5py_save(ctx: Ctx) -> list[dict[str, Any]]:
    return rows(ctx, ctx.save_loop("h5py", "h5-save", lambda path: save_h5py(ctx, path)))


@method("h5py-load")
def _h5py_load(ctx: Ctx) -> list[dict[str, Any]]:
    import h5py

    path = ctx.fixture("h5py")
    targets = [(name, torch.zeros_like(t)) for name, t in ctx.tensors]  # allocated and touched beforehand

    def once(p: Probe) -> None:
        with h5py.File(path / "state.h5", "r") as f:
            for name, t in targets:
                f[name].read_direct(t.numpy())
            json.loads(f.attrs["param_groups"])
        p.mark("h5-read-direct")

    return rows(ctx, ctx.load_loop(path, once))


@method("gpu-load")
def _gpu_load(ctx: Ctx) -> list[dict[str, Any]]:
    """Loads onto a GPU (run only where CUDA is present): ckptflow into fresh GPU tensors and into a
    GPU model's own, against ``torch.load(map_location="cuda")``; each timed to the GPU's last copy."""
    from ckptflow.storage import CheckpointStore

    if not torch.cuda.is_available():
        raise SystemExit("gpu-load needs a CUDA GPU")
    ours, theirs = ctx.fixture("ckptflow"), ctx.fixture("torch") / "state.pt"
    store = CheckpointStore(str(ours), options=ctx.store_options())
    target = moved(
        preallocated_like(ctx.state), "cuda"
    )  # a resumed run's model and optimizer, built on the GPU
    checked: set[str] = set()

    def once(label: str, load: Callable[[], Any]) -> Callable[[Probe], None]:
        def run(p: Probe) -> None:
            out = load()
            torch.cuda.synchronize()
            p.mark(label)
            if label not in checked:  # correctness guard, once per variant, untimed
                diff = first_difference(ctx.state, moved(out, "cpu"))
                if diff is not None:
                    raise AssertionError(f"{label} differs from the saved state at {diff}")
                checked.add(label)

        return run

    samples = ctx.load_loop(ours, once("gpu-ckpt-load", lambda: store.load(map_location="cuda")))
    samples |= ctx.load_loop(ours, once("gpu-ckpt-load-into", lambda: store.load(into=target)))
    load_theirs = lambda: torch.load(theirs, weights_only=True, map_location="cuda")  # noqa: E731
    samples |= ctx.load_loop(theirs.parent, once("gpu-torch-load", load_theirs))
    return rows(ctx, samples)


def moved(tree: Any, device: str) -> Any:
    """``tree`` with every tensor copied to ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: moved(v, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [moved(v, device) for v in tree]
    return tree


def make_ctx(args: argparse.Namespace, run_dir: Path) -> Ctx:
    state = build_state(args.size_mib)
    tensors = list(flat_tensors(state))
    return Ctx(args, run_dir, state, tensors, sum(t.nbytes for _, t in tensors))


def run_worker(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    # One untimed pass on a 1 MiB state first: lazy imports, thread pools and other
    # first-call costs stay out of the timings (save_async's 1st-call row still allocates).
    tiny = argparse.Namespace(**{**vars(args), "size_mib": 1, "repeats": 1, "cold": False})
    warmup = Path(args.run_dir) / f"warmup-{args.worker}"
    METHODS[args.worker](make_ctx(tiny, warmup))
    shutil.rmtree(warmup, ignore_errors=True)
    result = METHODS[args.worker](make_ctx(args, Path(args.run_dir)))
    Path(args.result).write_text(json.dumps(result))


# -- the table ---------------------------------------------------------------------------------------

# key -> (method, operation); {S} shards, {T} threads
LABELS = {
    "memcpy-touched": ("memcpy: `copy_` into a preallocated, touched buffer", "copy"),
    "memcpy-fresh": ("memcpy: `copy_` into fresh memory (`torch.empty`)", "copy"),
    "raw-write": ("plain `os.write` + fsync, 1 file, 1 thread", "save"),
    "raw-write-par": ("plain `os.write` + fsync, {S} files, {S} threads", "save"),
    "raw-read": ("plain `os.preadv`, 1 thread, into a preallocated buffer", "load"),
    "raw-read-par": ("plain `os.preadv`, {T} threads, into a preallocated buffer", "load"),
    "raw-read-fresh": ("plain `os.preadv`, {T} threads, into fresh memory", "load"),
    "ckpt-save": ("**ckptflow** `save` ({S} shards, {T} threads)", "save"),
    "ckpt-async-block-first": (
        "**ckptflow** `save_async`: caller blocked, 1st call of a fresh process (over `--first-samples`)",
        "block",
    ),
    "ckpt-async-block": ("**ckptflow** `save_async`: caller blocked (later calls)", "block"),
    "ckpt-async-total": ("**ckptflow** `save_async`: until `wait()` returns", "save"),
    "ckpt-load": ("**ckptflow** `load()` (fresh tensors, verify on)", "load"),
    "ckpt-load-noverify": ("**ckptflow** `load(verify=False)`", "load"),
    "ckpt-load-model": ('**ckptflow** `load(keys=["model"])` (1/3 of the bytes)', "load"),
    "torch-save": ("`torch.save` + fsync", "save"),
    "torch-load": ("`torch.load(weights_only=True)`", "load"),
    "torch-load-mmap": ("`torch.load(weights_only=True, mmap=True)`, untouched", "load"),
    "torch-load-mmap-touched": ("`torch.load(mmap=True)` + read every page", "load"),
    "torch-load-mmap-clone": ("`torch.load(mmap=True)` + read every page + `clone()`", "load"),
    "dcp-save-t1": ("DCP `save`, `FileSystemWriter(thread_count=1)`", "save"),
    "dcp-save-t2": ("DCP `save`, `FileSystemWriter(thread_count=2)`", "save"),
    "dcp-load": ("DCP `load` into existing tensors", "load"),
    "st-save": ("safetensors `save_file` + fsync", "save"),
    "st-load-mmap": ("safetensors `load_file` (mmap), untouched", "load"),
    "st-load-mmap-touched": ("safetensors `load_file` (mmap) + read every page", "load"),
    "st-load-pread": ('safetensors `load_file(backend="pread")`', "load"),
    "h5-save": ("h5py: 1 file, `create_dataset` per tensor + fsync", "save"),
    "h5-read-direct": ("h5py `read_direct` into existing arrays", "load"),
    "ckpt-load-into": ("**ckptflow** `load(into=existing)` (verify on)", "load"),
    "ckpt-verify": ("**ckptflow** `verify()`: every byte against shard and blob checksums", "load"),
    "gpu-ckpt-load": ('**ckptflow** `load(map_location="cuda")`', "load to GPU"),
    "gpu-ckpt-load-into": ("**ckptflow** `load(into=the GPU model's tensors)`", "load to GPU"),
    "gpu-torch-load": ('`torch.load(weights_only=True, map_location="cuda")`', "load to GPU"),
}

# key -> anchors whose time it is divided by
ANCHORS = {
    "ckpt-save": ["raw-write", "torch-save"],
    "ckpt-async-total": ["raw-write", "torch-save"],
    "ckpt-async-block-first": ["memcpy-fresh", "memcpy-touched"],
    "ckpt-async-block": ["memcpy-touched"],
    "ckpt-load": ["h5-read-direct", "torch-load", "raw-read-fresh"],
    "ckpt-load-noverify": ["h5-read-direct", "torch-load", "raw-read-fresh"],
    "ckpt-load-model": ["ckpt-load"],
    "ckpt-load-into": ["h5-read-direct", "torch-load", "raw-read-par"],
    "ckpt-verify": ["raw-read-par", "ckpt-load"],
    "gpu-ckpt-load": ["gpu-torch-load"],
    "gpu-ckpt-load-into": ["gpu-torch-load"],
}
ANCHOR_NAMES = {
    "raw-write": "plain write",
    "torch-save": "torch.save",
    "memcpy-fresh": "memcpy→fresh",
    "memcpy-touched": "memcpy",
    "h5-read-direct": "h5py read_direct",
    "torch-load": "torch.load",
    "raw-read-fresh": "plain read→fresh",
    "raw-read-par": "plain read",
    "ckpt-load": "full ckptflow load",
    "gpu-torch-load": "torch.load to GPU",
}
LIMITS = {"save": ("raw-write", "raw-write-par"), "load": ("raw-read", "raw-read-par")}


def gbps(row: dict[str, Any]) -> float:
    return row["nbytes"] / 1e9 / statistics.median(row["seconds"])


def render_table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by_key = {r["key"]: r for r in results}
    header = [
        "method",
        "op",
        f"seconds (median of {args.repeats}; min-max)",
        "GB/s",
        "extra peak RSS MiB",
        "x disk limit",
        "time vs anchors",
    ]
    rows = []
    for r in results:
        name, op = LABELS[r["key"]]
        secs = r["seconds"]
        cell = f"{statistics.median(secs):.3f}"
        if len(secs) > 1:
            cell += f" ({min(secs):.2f}-{max(secs):.2f})"
        limits = [gbps(by_key[k]) for k in LIMITS.get(op, ()) if k in by_key]
        limit = f"{max(limits) / gbps(r):.2f}" if limits else "—"
        anchors = [
            f"{statistics.median(secs) / statistics.median(by_key[a]['seconds']):.2f}x {ANCHOR_NAMES[a]}"
            for a in ANCHORS.get(r["key"], [])
            if a in by_key
        ]
        name = name.format(S=args.shards, T=args.threads)
        rows.append([name, op, cell, f"{gbps(r):.2f}", f"{r['peak_mib']:.0f}", limit, ", ".join(anchors)])
    return markdown_table(header, "llrrrrl", rows)


def notes(args: argparse.Namespace, state_desc: str) -> str:
    cache = (
        "**cold**: page cache dropped before each timed load"
        if args.cold
        else "**warm**: files read once before the timed loads, so loads come from the page cache "
        "(they measure the software, not the disk); run with `--cold` to read from the disk"
    )
    return "\n".join(
        [
            f"- State: {state_desc}.",
            f"- Loads: {cache}. Every save ends with its files and directory fsynced; `os.sync()` "
            "runs (untimed) before each save.",
            "- GB/s = tensor bytes handled / median seconds (the partial load handles the model's bytes).",
            "- x disk limit = best plain-I/O GB/s of the same direction / this row's GB/s "
            "(1.00 = as fast as the disk allows; warm loads: as fast as copying out of the page cache).",
            "- time vs anchors = this row's median seconds / the anchor's (below 1 = faster).",
            "- Extra peak RSS = VmHWM after - VmRSS before the timed call (VmHWM reset through "
            "`/proc/self/clear_refs`), max over repeats, each method in its own process. It includes "
            "page-cache pages an mmap maps in. `save_async` keeps its staging buffer (one copy of the "
            "state) between calls, so later calls show ~0 extra but the process holds it.",
            "- Every method allocates like the first load of a fresh process (`MALLOC_MMAP_THRESHOLD_` "
            "fixed at 128 KiB in the workers): fresh tensors pay their page faults in every repeat.",
            "- mmap rows: untouched = tensors not yet read; 'read every page' faults in one byte per page; "
            "mapped pages are copy-on-write, so an in-place update later pays a copy.",
        ]
    )


# -- the driver --------------------------------------------------------------------------------------


def machine_facts(run_dir: Path, args: argparse.Namespace) -> str:
    import h5py
    import numpy
    import safetensors

    dev, fstype, _ = mount_of(run_dir)
    disk = shutil.disk_usage(run_dir)
    return "\n".join(
        [
            f"- Machine: {machine()}, load average at start {load_average()}",
            f"- Software: Python {platform.python_version()}, torch {torch.__version__} "
            f"({args.torch_threads or torch.get_num_threads()} intra-op threads), h5py {h5py.__version__}, "
            f"safetensors {safetensors.__version__}, numpy {numpy.__version__}",
            f"- Disk: {run_dir} on {dev} ({fstype}), {disk.free / 2**30:.0f} GiB free of "
            f"{disk.total / 2**30:.0f} GiB",
        ]
    )


def describe_state(size_mib: int) -> str:
    shapes = model_shapes(size_mib * MiB // 3)
    model = 4 * sum(math.prod(s) for _, s in shapes)
    big = sum(1 for _, s in shapes if 4 * math.prod(s) >= MiB)
    return (
        f"{len(shapes)} fp32 parameters ({big} matrices ≥ 1 MiB, the largest "
        f"{max(4 * math.prod(s) for _, s in shapes) / MiB:.0f} MiB; the rest biases and norms), "
        f"{model / MiB:.0f} MiB, plus Adam `step`/`exp_avg`/`exp_avg_sq`: {3 * model / MiB:.0f} MiB "
        f"in {4 * len(shapes)} tensors"
    )


def run_method(name: str, args: argparse.Namespace, run_dir: Path) -> list[dict[str, Any]] | None:
    result = run_dir / f"result-{name}.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--run-dir", str(run_dir)]
    cmd += ["--result", str(result), "--size-mib", str(args.size_mib), "--repeats", str(args.repeats)]
    cmd += ["--shards", str(args.shards), "--threads", str(args.threads)]
    cmd += ["--torch-threads", str(args.torch_threads)] + (["--cold"] if args.cold else [])
    # glibc's mmap threshold fixed at its initial 128 KiB: every repeat gets fresh pages for the
    # tensors it allocates, as the first load of a fresh process does (otherwise repeats 2..R
    # reuse heap pages the previous repeat faulted in, and look faster than any real resume).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run(cmd, stdout=sys.stderr, check=False, env=env)
    if proc.returncode != 0:
        return None
    return json.loads(result.read_text())


def merged(runs: list[list[dict[str, Any]] | None]) -> list[dict[str, Any]] | None:
    """The rows of several runs of one method (fresh processes each), their samples together."""
    if any(r is None for r in runs):
        return None
    out: dict[str, dict[str, Any]] = {}
    for row in (row for r in runs for row in r or []):
        if row["key"] in out:
            out[row["key"]]["seconds"] += row["seconds"]
            out[row["key"]]["peak_mib"] = max(out[row["key"]]["peak_mib"], row["peak_mib"])
        else:
            out[row["key"]] = dict(row)
    return list(out.values())


def check_cold(args: argparse.Namespace) -> None:
    if args.cold and not os.access(DROP_CACHES, os.W_OK):
        raise SystemExit(f"--cold needs write access to {DROP_CACHES} (root, not a locked-down container)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per method; the median is shown")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir on disk)")
    p.add_argument("--only", default=None, help="comma list of methods: " + ", ".join(METHODS))
    p.add_argument("--shards", type=int, default=4, help="ckptflow shards (= files of the parallel write)")
    p.add_argument("--threads", type=int, default=4, help="ckptflow threads (and of the parallel plain read)")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch intra-op threads in the workers (default 0: torch's own default); 1 steadies "
        "copy_ timings on a machine whose cores are busy with other work",
    )
    p.add_argument(
        "--first-samples",
        type=int,
        default=5,
        help="fresh processes that each time their first save_async (default 5; the median is shown)",
    )
    p.add_argument("--cold", action="store_true", help="drop the page cache before each timed load (root)")
    p.add_argument("--markdown-out", type=Path, default=None, help="also write the report to this file")
    p.add_argument("--keep", action="store_true", help="keep the files written")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.size_mib < 1:
        p.error("--repeats and --size-mib must be >= 1")
    if args.only:
        unknown = set(args.only.split(",")) - set(METHODS)
        if unknown:
            p.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    check_cold(args)
    base = args.dir or disk_temp_dir()
    base.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="ckptflow-bench-", dir=base))
    default = [m for m in METHODS if m != "gpu-load" or torch.cuda.is_available()]
    selected = [m for m in METHODS if m in args.only.split(",")] if args.only else default
    facts = machine_facts(run_dir, args)
    print(facts, file=sys.stderr)
    start = time.perf_counter()
    results, failed = [], []
    try:
        for i, name in enumerate(selected, 1):
            t0 = time.perf_counter()
            print(f"[{i}/{len(selected)}] {name} ...", file=sys.stderr, flush=True)
            runs = args.first_samples if name == "ckptflow-save-async-first" else 1
            got = merged([run_method(name, args, run_dir) for _ in range(runs)])
            if got is None:
                failed.append(name)
            results += got or []
            took = time.perf_counter() - t0
            print(f"[{i}/{len(selected)}] {name}: {took:.1f}s", file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    report = "\n\n".join(
        [
            f"## ckptflow storage benchmark: {args.size_mib} MiB state, {args.repeats} repeats",
            facts,
            render_table(results, args),
            notes(args, describe_state(args.size_mib))
            + f"\n- Whole run: {time.perf_counter() - start:.0f} s; load average at the end {load_average()}."
            + (f"\n- **FAILED** (see stderr): {', '.join(failed)}" if failed else ""),
        ]
    )
    emit(report, args.markdown_out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
