"""Where the CPU of an epoch's orchestration goes: the floor of ckptflow's per-epoch overhead.

bench_pipeline.py measures the overhead per epoch in wall time. On a machine
whose cores are all busy training (2 ranks on 2 cores), every CPU second spent
elsewhere (the Prefect server recording task runs, the flow's process, the
launcher) is taken from the ranks. This script counts those seconds, from
/proc, per process:

- ``ckptflow run --nproc 2`` against a running Prefect server, at E1 and E2
  epochs: the difference, divided by E2 - E1, is the CPU per epoch of the
  server, the flow, the launcher and the ranks (start-up cancels out);
- a flow of two empty task runs per "epoch" (what ckptflow runs per epoch:
  train_epoch, save_checkpoint) against the same server: Prefect's own CPU per
  epoch, which no orchestration through Prefect tasks can go below.

The floor of the wall-time overhead is then the orchestration's CPU per epoch
divided by the cores it has to share with the ranks.

    .venv/bin/python bench/bench_orchestration_cpu.py [--epochs 20 60]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, markdown_table  # noqa: E402
from tests.prefect_server import start_prefect_server  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")

EMPTY_TASKS = r"""
import sys
from prefect import flow, task
@task(name="train_epoch")
def train(epoch): return epoch
@task(name="save_checkpoint")
def save(epoch): return epoch
@flow(name="two-empty-tasks-per-epoch")
def epochs(n: int):
    for epoch in range(1, n + 1):
        train(epoch); save(epoch)
epochs(int(sys.argv[1]))
"""


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU of ``pid`` itself (not of its children)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for thread in threads:
        with contextlib.suppress(OSError):
            found += [int(c) for c in Path(f"/proc/{pid}/task/{thread}/children").read_text().split()]
    return found


def tree_cpu(root: int) -> float:
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += cpu_seconds(pid) or 0.0
        stack += children(pid)
    return total


def role(depth: int, rank_index: int) -> str:
    return {0: "flow process", 1: "launcher (elastic agent)"}.get(depth, f"rank {rank_index}")


def run_watched(cmd: list[str], env: dict[str, str], server_pid: int) -> dict[str, float]:
    """CPU seconds by role of the command's process tree, and the server's, while it ran."""
    before = tree_cpu(server_pid)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    last: dict[int, tuple[int, float]] = {}  # pid -> (depth, CPU seconds when last seen)
    while proc.poll() is None:
        stack = [(proc.pid, 0)]
        while stack:
            pid, depth = stack.pop()
            seconds = cpu_seconds(pid)
            if seconds is not None:
                last[pid] = (depth, seconds)
            stack += [(c, depth + 1) for c in children(pid)]
        time.sleep(0.02)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stderr.read().decode()[-3000:] if proc.stderr else ''}")
    time.sleep(2)  # the server finishes recording the last task runs
    out = {"Prefect server": tree_cpu(server_pid) - before}
    ranks = sorted(pid for pid, (depth, _) in last.items() if depth >= 2)
    for pid, (depth, seconds) in last.items():
        name = role(depth, ranks.index(pid) if pid in ranks else 0)
        out[name] = out.get(name, 0.0) + seconds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, nargs=2, default=[20, 60], metavar=("E1", "E2"))
    args = parser.parse_args()
    e1, e2 = args.epochs
    py, ckptflow = sys.executable, str(Path(sys.executable).parent / "ckptflow")
    spec = "bench.timing_spec:TimedDigits"
    with tempfile.TemporaryDirectory(prefix="ckptflow-bench-cpu-") as tmp_name:
        tmp = Path(tmp_name)
        server = start_prefect_server(tmp / "server-home")
        try:
            env = {**server.env(), "PYTHONPATH": str(ROOT)}
            runs = {}
            for epochs in (e1, e2):
                store = tmp / f"store{epochs}"
                runs["ckptflow", epochs] = run_watched(
                    [
                        ckptflow,
                        "run",
                        "--spec",
                        spec,
                        "--epochs",
                        str(epochs),
                        "--nproc",
                        "2",
                        "--storage",
                        str(store),
                    ],
                    env,
                    server.process.pid,
                )
                runs["empty", epochs] = run_watched(
                    [py, "-c", EMPTY_TASKS, str(epochs)], env, server.process.pid
                )
        finally:
            server.stop()
    per_epoch = {
        kind: {
            name: 1000 * (runs[kind, e2][name] - runs[kind, e1].get(name, 0.0)) / (e2 - e1)
            for name in runs[kind, e2]
        }
        for kind in ("ckptflow", "empty")
    }
    ours, empty = per_epoch["ckptflow"], {"Prefect server": 0.0, **per_epoch["empty"]}
    names = ["Prefect server", "flow process", "launcher (elastic agent)", "rank 0", "rank 1"]
    rows = [
        [name, f"{ours.get(name, 0.0):.1f}", f"{empty.get(name, 0.0):.1f}" if name in empty else ""]
        for name in names
    ]
    print(f"\nCPU per epoch (ms), epochs {e1} -> {e2} of the digits demo at W=2, {machine()}\n")
    print(
        markdown_table(
            ["process", "ckptflow run --nproc 2", "two empty Prefect tasks per epoch"], "lrr", rows
        )
    )
    orchestration = sum(ours.get(name, 0.0) for name in names[:3])
    prefect_own = empty["Prefect server"] + empty.get("flow process", 0.0)
    cores = os.cpu_count() or 1
    print(
        f"\norchestration (server + flow + launcher): {orchestration:.1f} ms of CPU per epoch; "
        f"Prefect's own for two task runs (server + flow): {prefect_own:.1f} ms"
    )
    print(
        f"with the ranks using all {cores} cores, the orchestration's wall-time floor is about "
        f"{orchestration / cores:.1f} ms per epoch (Prefect's own: {prefect_own / cores:.1f} ms)"
    )


if __name__ == "__main__":
    main()
