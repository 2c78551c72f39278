"""Multi-process save benchmark: ckptflow's distributed store against torch.distributed.checkpoint.

W processes (gloo on 127.0.0.1) hold the same replicated state of ``--size-mib``
(a DDP job's model and Adam state: many fp32 tensors of a few MiB) and save it
with each method, W = 1 and W = 2:

- ``ckptflow``: ``CheckpointStore(dir, distributed=True).save(state, rank_state=...)``:
  each rank writes its share of the replicated state, rank 0 commits.
- ``dcp``: ``torch.distributed.checkpoint.save`` with a ``FileSystemWriter``
  (``sync_files=True``, its default; its default planner also writes each
  replicated tensor once, spread over the ranks).

Fairness: every save ends with its files fsynced; dirty pages are flushed
(``os.sync``) before each timed save; the timed span runs from a barrier before
the save to a barrier after it (the job's save time, as the slowest rank sees
it); each method first saves a 1 MiB state untimed (imports, thread pools);
methods alternate within each repeat; the median of R repeats is reported.

Run: ``.venv/bin/python bench/bench_distributed.py [--size-mib 1024] [--repeats 3] [--worlds 1,2]``.
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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file or with -m

from tests.ports import free_port

METHODS = ("ckptflow", "dcp")
TENSOR_MIB = 4


def make_state(size_mib: int) -> dict[str, Any]:
    """A replicated training state of about ``size_mib``: model, exp_avg and exp_avg_sq in thirds."""
    per = max(1, size_mib // 3 // TENSOR_MIB)
    numel = TENSOR_MIB * (1 << 20) // 4
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(per)}
    adam = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn(numel, generator=gen),
            "exp_avg_sq": torch.rand(numel, generator=gen),
        }
        for i in range(per)
    }
    return {
        "model": model,
        "optimizer": {"state": adam, "param_groups": [{"lr": 1e-3, "params": list(range(per))}]},
    }


def nbytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    if isinstance(state, list):
        return sum(nbytes(v) for v in state)
    return 0


def save_ckptflow(store: Any, state: dict[str, Any], path: Path) -> None:
    from ckptflow.storage import CheckpointStore

    store = CheckpointStore(path, distributed=store)
    store.save(state, rank_state={"rng": torch.get_rng_state()})


def save_dcp(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True))


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ckptflow.storage import RankGroup

    group = RankGroup.create()
    root = Path(args.dir)
    warm, state = make_state(3), make_state(args.size_mib)

    def run(method: str, payload: dict[str, Any], path: Path) -> float:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        os.sync()
        dist.barrier()
        start = time.perf_counter()
        if method == "ckptflow":
            save_ckptflow(group, payload, path)
        else:
            save_dcp(payload, path)
        dist.barrier()
        seconds = time.perf_counter() - start
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        return seconds

    for method in METHODS:
        run(method, warm, root / f"warm-{method}")
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for r in range(args.repeats):
        order = METHODS if r % 2 == 0 else tuple(reversed(METHODS))
        for method in order:
            times[method].append(run(method, state, root / f"{method}-{r}"))
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "bytes": nbytes(state)}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under the repo)")
    args = parser.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-dist-", dir=Path(__file__).resolve().parent))
    args.dir = str(base)
    rows = []
    try:
        for world in [int(w) for w in args.worlds.split(",")]:
            out = base / f"result-{world}.json"
            mp.spawn(worker, args=(world, free_port(), args, str(out)), nprocs=world, join=True)
            result = json.loads(out.read_text())
            med = {m: statistics.median(t) for m, t in result["times"].items()}
            gib = result["bytes"] / (1 << 30)
            rows.append((world, gib, med, result["times"]))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\nreplicated state {rows[0][1]:.2f} GiB, {os.cpu_count()} cores, median of {args.repeats}\n")
    header = ["W", "ckptflow s", "DCP s", "ckptflow GB/s", "DCP GB/s", "speed vs DCP", "runs: ckptflow / DCP"]
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|---|---|---|")
    for world, gib, med, times in rows:
        gb = gib * (1 << 30) / 1e9
        runs = " / ".join(", ".join(f"{t:.3f}" for t in times[m]) for m in METHODS)
        print(  # speed ratio: DCP's time over ours
            f"| {world} | {med['ckptflow']:.3f} | {med['dcp']:.3f} | {gb / med['ckptflow']:.2f} | "
            f"{gb / med['dcp']:.2f} | {med['dcp'] / med['ckptflow']:.2f}x | {runs} |"
        )


if __name__ == "__main__":
    main()
