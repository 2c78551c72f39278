"""Sharded state (FSDP2 + Adam) benchmark: ckptflow against torch.distributed.checkpoint's own files.

W processes (gloo on 127.0.0.1) hold an FSDP2 model of ``--size-mib`` of model
and Adam state together (DTensors sharded over the ranks on dim 0), from
``get_state_dict``. Each timed span runs from a barrier to a barrier after the
call (the job's time, as its slowest rank sees it); dirty pages are flushed
(``os.sync``) before each timed save; both methods fsync their files
(``FileSystemWriter(sync_files=True)``, DCP's default); each method first
saves and loads a small model untimed; methods alternate; medians of R.

- save: ``store.save(state)`` on a distributed store / ``dcp.save`` to a
  ``FileSystemWriter``; and its floor: each rank writes its bytes to 4 files
  by 4 threads and fsyncs them, what any save must at least do on this disk;
- async stall: how long ``store.save_async(state)`` / ``dcp.async_save``
  block the training loop, at the first call of the process (against the
  process's first copy of this rank's shards, into fresh memory) and at a
  later one (against a copy into memory already mapped);
- load: ``store.load(into=state)`` / ``dcp.load`` with a
  ``FileSystemReader``, at the world size that saved (W=1 and W=2), and
  resharded: the W=2 save loaded at W=1 and W=3; also ckptflow's load with
  its checksums off (``verify=False``: DCP's reader checks none), and the
  load's floor: DCP's planning with nothing read, a copy of each rank's
  bytes (on GPUs: host copies of them into the GPU tensors), and their xxh3
  (what a verified load computes).

Run: ``.venv/bin/python bench/bench_sharded.py [--size-mib 1024] [--repeats 3]``. On GPUs,
``--device cuda [--worlds 1]`` (one GPU per rank, NCCL for the model, gloo for the store): the
shards are staged to host through the store's pinned buffers, each chunk written as its own copy
ends (a sync save) or all copies synchronised once (save_async, DCP's own stager).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file or with -m

from tests.ports import free_port

METHODS = ("ckptflow", "dcp")
WIDTH = 1024


def build(size_mib: int, world: int, device: str = "cpu") -> tuple[Any, Any]:
    """An FSDP2 MLP of about ``size_mib`` of parameters and Adam state (3x the parameters), on
    ``device`` ("cpu", or "cuda": one GPU per rank)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = max(1, size_mib * (1 << 20) // 3 // (WIDTH * WIDTH * 4))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))).to(device)
    mesh = init_device_mesh(device, (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH, device=device)).sum().backward()
    opt.step()
    return model, opt


def state_of(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}


def local_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(state))


def clone_local(state: Any) -> Any:
    """A host copy of this rank's shards and tensors (from a GPU: what staging must at least do)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local().to("cpu", copy=True)
    if isinstance(state, torch.Tensor):
        return state.to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: clone_local(v) for k, v in state.items()}
    return state


def assert_same(expected: Any, found: Any, when: str) -> None:
    """The benchmark measures only round trips that return the state bit for bit."""
    if isinstance(expected, torch.Tensor):
        if not (
            expected.dtype == found.dtype
            and torch.equal(expected.view(-1).view(torch.uint8), found.view(-1).view(torch.uint8))
        ):
            raise AssertionError(f"a tensor differs from the saved state {when}")
    elif isinstance(expected, dict):
        for k in expected:
            assert_same(expected[k], found[k], when)


def timed(call: Any, *args: Any) -> float:
    """Seconds of ``call(*args)`` from a barrier to a barrier: the job's time, as its slowest rank sees it."""
    dist.barrier()
    start = time.perf_counter()
    call(*args)
    dist.barrier()
    return time.perf_counter() - start


def save(method: str, state: dict[str, Any], path: Path, store: Any) -> None:
    import torch.distributed.checkpoint as dcp

    if method == "ckptflow":
        store.save(state)
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True))


def load(method: str, state: dict[str, Any], path: Path, store: Any) -> None:
    import torch.distributed.checkpoint as dcp

    if method == "ckptflow":
        store.load(into=state)
    elif method == "unverified":  # ckptflow without its checksums, as DCP reads
        store.load(into=state, verify=False)
    else:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))


def plan_only(state: dict[str, Any], store: Any) -> None:
    """``store.load(into=state)`` with nothing read: DCP's planning and collectives, the manifest."""
    from ckptflow.storage.sharded.reader import DcpReader

    def read_nothing(self: Any, plan: Any, planner: Any) -> Any:
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    real = DcpReader.read_data
    DcpReader.read_data = read_nothing  # type: ignore[method-assign]
    try:
        store.load(into=state)
    finally:
        DcpReader.read_data = real  # type: ignore[method-assign]


FLOOR_FILES = 4  # the store's default shards per rank, written by as many threads


def write_floor(state: dict[str, Any], path: Path) -> None:
    """What any save must at least do: this rank's bytes (host copies of its shards) into
    FLOOR_FILES files of its own, written side by side by as many threads and fsync'd; no
    planning, no checksums, no commit."""
    from concurrent.futures import ThreadPoolExecutor

    groups: list[list[torch.Tensor]] = [[] for _ in range(FLOOR_FILES)]
    sizes = [0] * FLOOR_FILES
    for tensor in sorted(local_tensors(state), key=lambda t: -t.numel() * t.element_size()):
        smallest = sizes.index(min(sizes))
        groups[smallest].append(tensor)
        sizes[smallest] += tensor.numel() * tensor.element_size()

    def write(n: int) -> None:
        with open(path / f"floor-r{dist.get_rank()}-{n}", "wb") as out:
            for tensor in groups[n]:
                out.write(host_bytes(tensor))
            out.flush()
            os.fsync(out.fileno())

    with ThreadPoolExecutor(FLOOR_FILES) as pool:
        list(pool.map(write, range(FLOOR_FILES)))


def local_tensors(state: Any) -> Iterator[torch.Tensor]:
    """This rank's tensors in ``state``: its DTensors' local shards and its plain tensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        yield state.to_local()
    elif isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from local_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from local_tensors(value)


def upload(host: dict[str, Any], state: dict[str, Any]) -> None:
    """Host copies of this rank's tensors into its GPU tensors: the part of a load's floor that a
    copy out of the page cache is on CPU (the host side of a GPU load is in the xxh3 row's copy)."""
    for source, target in zip(local_tensors(host), local_tensors(state), strict=True):
        target.copy_(source)
    torch.cuda.synchronize()


def hash_local(state: dict[str, Any]) -> None:
    """The xxh3 of each of this rank's tensors: what a verified load computes besides its copy."""
    from ckptflow.storage.format.checksum import digest

    for tensor in local_tensors(state):
        digest(host_bytes(tensor))


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in host memory (copied there from a GPU)."""
    return memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def bytes_read() -> int:
    """Bytes this process has read through read(2)-like calls (page cache included), from /proc."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def timed_load(
    method: str, state: dict[str, Any], path: Path, store: Any, results: dict[str, list[float]]
) -> None:
    """A timed load, and the bytes the whole job read for it (summed over the ranks)."""
    before = bytes_read()
    results.setdefault(f"load {method}", []).append(timed(load, method, state, path, store))
    total = torch.tensor([bytes_read() - before], dtype=torch.int64)
    dist.all_reduce(total)
    results.setdefault(f"read {method}", []).append(float(total.item()))


def start_async(method: str, state: dict[str, Any], path: Path, store: Any, pending: list[Any]) -> None:
    """Start an async save. DCP's runs its collectives on a gloo group of its own, as its docs advise
    (ckptflow's store has one), so that they never meet the training loop's."""
    import torch.distributed.checkpoint as dcp

    if method == "ckptflow":
        pending.append(store.save_async(state))
    else:
        writer = dcp.FileSystemWriter(str(path), sync_files=True)
        pending.append(dcp.async_save(state, storage_writer=writer, process_group=ASYNC_GROUP[0]))


ASYNC_GROUP: list[Any] = []


def start_group(rank: int, world: int, port: int, device: str) -> None:
    """The job's process group: gloo on CPU; on GPUs, NCCL for CUDA tensors (one GPU per rank)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)


def saver(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """Save, async stalls and load at ``world`` ranks; leaves the last saves under ``args.dir/w<W>``."""
    from ckptflow.storage import CheckpointStore

    start_group(rank, world, port, args.device)
    root = Path(args.dir) / f"w{world}"
    ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    warm_model, warm_opt = build(8, world, args.device)
    model, opt = build(args.size_mib, world, args.device)
    state, warm = state_of(model, opt), state_of(warm_model, warm_opt)
    results: dict[str, list[float]] = {}

    def fresh(name: str) -> Path:
        path = root / name
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        os.sync()
        dist.barrier()
        return path

    expected = clone_local(state)
    results["copy fresh"] = [timed(clone_local, state)]  # the process's first copy: into fresh pages
    results["copy"] = [timed(clone_local, state) for _ in range(args.repeats)]  # pages already mapped
    for method in METHODS:  # imports, thread pools, the store's group
        path = fresh(f"warm-{method}")
        save(method, warm, path, CheckpointStore(path, distributed=True) if method == "ckptflow" else None)
        load(method, warm, path, CheckpointStore(path, distributed=True) if method == "ckptflow" else None)
    results.update({f"async first {m}": [] for m in METHODS})
    for r in range(args.repeats):
        order = METHODS if r % 2 == 0 else tuple(reversed(METHODS))
        for method in order:
            path = fresh(method)
            store = CheckpointStore(path, distributed=True) if method == "ckptflow" else None
            results.setdefault(f"save {method}", []).append(timed(save, method, state, path, store))
            if method == "ckptflow":
                results.setdefault("write", []).append(timed(write_floor, state, fresh("floor")))
            timed_load(method, state, path, store, results)
            if store is not None:
                results.setdefault("plan", []).append(timed(plan_only, state, store))
                results.setdefault("hash", []).append(timed(hash_local, expected))
                land_floor(args.device, expected, state, results)
                timed_load("unverified", state, path, store, results)
    assert_same(expected, clone_local(state), "after the loads")
    for method in METHODS:  # async: a first call in this process, then a later one (same store)
        base = fresh(f"async-{method}")
        store = CheckpointStore(base, distributed=True) if method == "ckptflow" else None
        for label in ("first", "later"):
            path = fresh(f"async-{method}/{label}") if store is None else base
            pending: list[Any] = []
            results.setdefault(f"async {label} {method}", []).append(
                timed(start_async, method, state, path, store, pending)
            )
            for handle in pending:
                handle.wait() if store is not None else handle.result()
        if store is not None:
            load(method, state, base, store)  # the later async save, read back
            assert_same(expected, clone_local(state), "after the async saves")
            store.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": results, "local_bytes": local_bytes(state)}))
    dist.barrier()
    dist.destroy_process_group()


def loader(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """The W=2 saves (``args.dir/w2``), loaded at ``world`` ranks."""
    from ckptflow.storage import CheckpointStore

    start_group(rank, world, port, args.device)
    model, opt = build(args.size_mib, world, args.device)
    state = state_of(model, opt)
    root = Path(args.dir) / "w2"
    store = CheckpointStore(root / "ckptflow", distributed=True)
    results: dict[str, list[float]] = {
        "copy": [timed(clone_local, state) for _ in range(args.repeats + 1)][1:]
    }
    load("ckptflow", state, root / "ckptflow", store)  # imports and thread pools, untimed
    host = clone_local(state)
    for r in range(args.repeats):
        order = METHODS if r % 2 == 0 else tuple(reversed(METHODS))
        for method in order:
            os.sync()
            timed_load(method, state, root / method, store, results)
        results.setdefault("plan", []).append(timed(plan_only, state, store))
        results.setdefault("hash", []).append(timed(hash_local, host))
        land_floor(args.device, host, state, results)
        timed_load("unverified", state, root / "ckptflow", store, results)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": results}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under the repo)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model lives")
    parser.add_argument(
        "--worlds", default="1,2", help="world sizes that save; 2 among them adds the W=2 -> 1, 3 loads"
    )
    args = parser.parse_args()
    args.worlds = [int(w) for w in args.worlds.split(",")]
    if args.device == "cuda" and max(args.worlds) > torch.cuda.device_count():
        parser.error(f"--device cuda needs a GPU per rank: {torch.cuda.device_count()} here")
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-sharded-", dir=Path(__file__).resolve().parent))
    args.dir = str(base)
    found: dict[str, dict[str, float]] = {}
    try:
        for world in args.worlds:
            out = base / f"save-{world}.json"
            mp.spawn(saver, args=(world, free_port(), args, str(out)), nprocs=world, join=True)
            result = json.loads(out.read_text())
            found[f"W={world}"] = {k: statistics.median(v) for k, v in result["times"].items()}
        gpus = torch.cuda.device_count() if args.device == "cuda" else 3
        for world in [w for w in (1, 3) if 2 in args.worlds and w <= gpus]:  # the W=2 save resharded
            out = base / f"load-{world}.json"
            mp.spawn(loader, args=(world, free_port(), args, str(out)), nprocs=world, join=True)
            result = json.loads(out.read_text())
            found[f"W=2 -> {world}"] = {k: statistics.median(v) for k, v in result["times"].items()}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(found, args)


def land_floor(
    device: str, host: dict[str, Any], state: dict[str, Any], results: dict[str, list[float]]
) -> None:
    """The copy in a load's floor: on CPU, a copy of this rank's bytes into memory already mapped
    (``copy``); on GPUs, host copies of them into the GPU tensors."""
    if device == "cuda":
        results.setdefault("land", []).append(timed(upload, host, state))


def floor_rows(world: str, r: dict[str, float]) -> list[list[str]]:
    """ckptflow without its checksums (as DCP reads), and the floor of a load through DCP's
    planner: its planning (nothing read), one copy of each rank's bytes (out of the page cache, as
    a load must) and, verified, their xxh3, each timed alone (a load that hashes each piece as it
    lands, still in the CPU cache, can beat their sum); DCP's load against it."""
    land = r.get("land", r["copy"])
    where = "to the GPU " if "land" in r else ""
    plain = r["plan"] + land
    floor = plain + r["hash"]
    unverified, theirs = r["load unverified"], r["load dcp"]
    return [
        [
            f"load, {world}, checksums off (`verify=False`; DCP checks none)",
            f"{unverified:.3f}",
            f"{theirs:.3f}",
            f"{theirs / unverified:.2f}x",
        ],
        [
            f"load floor, {world}: planning alone ({r['plan']:.3f} s) + a copy of each rank's bytes "
            f"{where}({land:.3f} s) + their xxh3 ({r['hash']:.3f} s)",
            f"{floor:.3f} (ours {r['load ckptflow'] / floor:.2f}x it)",
            "",
            f"{theirs / floor:.2f}x (DCP over the floor; {theirs / plain:.2f}x unverified)",
        ],
    ]


def print_table(found: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    from bench.common import machine, markdown_table

    rows = []
    for world in [w for w in ("W=1", "W=2") if w in found]:
        r = found[world]
        for what in ("save", "load"):
            ours, theirs = r[f"{what} ckptflow"], r[f"{what} dcp"]
            rows.append([f"{what}, {world}", f"{ours:.3f}", f"{theirs:.3f}", f"{theirs / ours:.2f}x"])
            if what == "save":
                rows.append(
                    [
                        f"save floor, {world}: each rank's bytes written to {FLOOR_FILES} files "
                        "by as many threads, fsync'd",
                        f"{r['write']:.3f} (ours {ours / r['write']:.2f}x it)",
                        "",
                        f"{theirs / r['write']:.2f}x (DCP over the floor)",
                    ]
                )
        rows.extend(floor_rows(world, r))
        for label in ("first", "later"):
            ours, theirs = r[f"async {label} ckptflow"], r[f"async {label} dcp"]
            copy = r["copy fresh"] if label == "first" else r["copy"]
            into = "fresh memory" if label == "first" else "mapped memory"
            rows.append(
                [
                    f"save_async stall, {label} call, {world} (a copy into {into}: {copy:.3f} s)",
                    f"{ours:.3f} ({ours / copy:.2f}x copy)",
                    f"{theirs:.3f}",
                    f"{theirs / ours:.2f}x",
                ]
            )
    for world in [w for w in ("W=2 -> 1", "W=2 -> 3") if w in found]:
        r = found[world]
        ours, theirs = r["load ckptflow"], r["load dcp"]
        rows.append([f"resharded load, {world}", f"{ours:.3f}", f"{theirs:.3f}", f"{theirs / ours:.2f}x"])
        rows.extend(floor_rows(world, r))
    for world in [w for w in ("W=1", "W=2", "W=2 -> 1", "W=2 -> 3") if w in found]:
        r = found[world]
        ours, theirs = r["read ckptflow"] / 2**20, r["read dcp"] / 2**20
        rows.append(
            [f"MiB the job reads to load, {world}", f"{ours:.0f}", f"{theirs:.0f}", f"{theirs / ours:.2f}x"]
        )
    where = "on CUDA, staged through pinned host memory" if args.device == "cuda" else "on CPU"
    print(
        f"\nFSDP2 model + Adam {where}, {args.size_mib} MiB in all, median of {args.repeats}, {machine()}\n"
    )
    print(markdown_table(["", "ckptflow (s)", "DCP (s)", "DCP's time / ours"], "lrrr", rows))


if __name__ == "__main__":
    main()
