"""Orchestration overhead of the Prefect pipeline against a plain training loop.

Runs the demo (digits MLP) for N epochs, saving every epoch, several ways, each
in a fresh process, R times each (interleaved; medians shown):

- plain:      the same spec and CheckpointStore calls in a Python loop, no Prefect
- as a Prefect flow: the plain loop decorated as a flow with two empty task runs
              per epoch (rank 0 of 2 ranks runs it), against the server: what the
              two task runs ckptflow makes per epoch (train_epoch, save_checkpoint)
              cost a loop that runs them itself
- floor:      Prefect's own floor: a trivial flow with one task (time to the task body)
- ephemeral:  `ckptflow run` with Prefect's temporary local API server
- server:     `ckptflow run` against a running `prefect server start` (PREFECT_API_URL set)
- in-process: the same with `--in-process` (the model in the CLI's process, not a child)
- 2 ranks:    the plain loop as a 2-rank torch.distributed program under `torchrun
              --standalone`, against `ckptflow run --nproc 2` (server): the same
              flow loop and tasks driving two ranks (W=1 rows are the plain and
              server rows above)

and prints one table: time from process start to the first epoch starting,
the time the epochs took, and the overhead per epoch against the plain loop.
A second table times the inspection commands (``ckptflow ls``, ``show``,
``verify``) on the run's store against ``python -c "import torch"``, the
floor of any tool that imports torch.

    .venv/bin/python bench/bench_pipeline.py [--epochs 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, markdown_table  # noqa: E402
from tests.prefect_server import prefect_env, start_prefect_server  # noqa: E402

# The plain loop, in one process or (``RANKS = True``) as one rank of a torch.distributed program:
# the same spec and store calls the pipeline makes, no Prefect.
PLAIN = r"""
import sys
from ckptflow.storage import CheckpointStore
from ckptflow.tasks.training.training_state import capture, seed_everything, split_ranked
from bench.timing_spec import TimedDigits
RANKS = "--ranks" in sys.argv
if RANKS:
    import torch.distributed as dist
    dist.init_process_group("gloo")
# --tasks: Prefect's own floor per epoch: rank 0 runs the loop as a flow with two empty task runs per epoch
TASKS = "--tasks" in sys.argv and (not RANKS or dist.get_rank() == 0)
store = CheckpointStore(sys.argv[1], distributed=RANKS)
spec = TimedDigits({}, seed=0)
seed_everything(0)
t = spec.build()
def tick(epoch):
    return epoch
def loop():
    handle = None
    for epoch in range(1, int(sys.argv[2]) + 1):
        m = spec.train_epoch(t, epoch); m.update(spec.evaluate(t, epoch)); m.pop("steps")
        tick(epoch)
        if handle is not None:
            handle.wait()
        state = capture(t, spec, epoch=epoch, step=0)
        shared, own = split_ranked(state) if RANKS else (state, None)
        handle = store.save_async(shared, rank_state=own, epoch=epoch, metrics=m, version=epoch)
        tock(epoch)
    handle.wait()
if TASKS:
    from prefect import flow, task
    tick, tock = task(name="train_epoch")(tick), task(name="save_checkpoint")(tick)
    flow(name="prefect-floor")(loop)()
else:
    tock = tick
    loop()
store.close()
if RANKS:
    dist.barrier()
    dist.destroy_process_group()
else:
    TimedDigits.mark("end")
assert TASKS or "prefect" not in sys.modules, "the plain loop imported Prefect"
"""

FLOOR = r"""
import os, time
from prefect import flow, task
@task
def first():
    with open(os.environ["CKPTFLOW_BENCH_TIMES"], "a") as f:
        f.write(f"first_epoch {time.time()}\n")
@flow
def trivial():
    first()
trivial()
"""


def run_child(cmd: list[str], env: dict[str, str], times: Path) -> dict[str, float]:
    times.write_text("")
    env = {**env, "CKPTFLOW_BENCH_TIMES": str(times), "PYTHONPATH": str(ROOT)}
    start = time.time()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    end = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    marks: dict[str, float] = {}
    for line in times.read_text().splitlines():
        name, value = line.split()
        marks.setdefault(name, float(value))
        if name == "epoch_end":
            marks["epoch_end"] = float(value)
    return {
        "to_first_epoch": marks["first_epoch"] - start,
        "epochs": marks.get("epoch_end", marks["first_epoch"]) - marks["first_epoch"],
        "total": end - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind; medians are shown")
    args = parser.parse_args()
    py = sys.executable
    ckptflow = str(Path(py).parent / "ckptflow")
    spec = "bench.timing_spec:TimedDigits"
    with tempfile.TemporaryDirectory(prefix="ckptflow-bench-") as tmp_name:
        tmp = Path(tmp_name)
        times = tmp / "times.txt"
        home = tmp / "prefect-home"
        base = prefect_env(home)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in KINDS}
        run_cmd = [ckptflow, "run", "--spec", spec, "--epochs", str(args.epochs)]
        plain_ranks = tmp / "plain_ranks.py"
        plain_ranks.write_text(PLAIN)
        torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        torchrun += ["--log-dir", str(tmp / "torchrun-logs"), str(plain_ranks)]
        # warm the ephemeral database once (first start creates and migrates it), as a user's second run would
        run_child([py, "-c", FLOOR], base, times)
        server = start_prefect_server(tmp / "server-home")
        try:
            env = server.env()
            for i in range(args.repeats):  # interleaved, so a slow spell of the machine hits every kind
                store = tmp / f"run{i}"
                runs["plain loop"].append(
                    run_child([py, "-c", PLAIN, str(store / "plain"), str(args.epochs)], base, times)
                )
                runs["plain loop as a Prefect flow, server"].append(
                    run_child([py, "-c", PLAIN, str(store / "pf"), str(args.epochs), "--tasks"], env, times)
                )
                runs["prefect floor, ephemeral"].append(run_child([py, "-c", FLOOR], base, times))
                runs["ckptflow run, ephemeral"].append(
                    run_child([*run_cmd, "--storage", str(store / "eph")], base, times)
                )
                runs["prefect floor, server"].append(run_child([py, "-c", FLOOR], env, times))
                runs["ckptflow run, server"].append(
                    run_child([*run_cmd, "--storage", str(store / "srv")], env, times)
                )
                runs["ckptflow run --in-process, server"].append(
                    run_child([*run_cmd, "--in-process", "--storage", str(store / "inp")], env, times)
                )
                runs["plain loop, 2 ranks (torchrun)"].append(
                    run_child([*torchrun, str(store / "p2"), str(args.epochs), "--ranks"], base, times)
                )
                flow2 = [*torchrun, str(store / "pf2"), str(args.epochs), "--ranks", "--tasks"]
                runs["plain loop as a Prefect flow, 2 ranks, server"].append(run_child(flow2, env, times))
                runs["ckptflow run --nproc 2, server"].append(
                    run_child([*run_cmd, "--nproc", "2", "--storage", str(store / "srv2")], env, times)
                )
            commands = time_commands(py, ckptflow, tmp / "run0" / "srv", args.repeats)
            commands["ckptflow run on a store a running run holds (refused, exit 75)"] = time_refusal(
                [*run_cmd[:-1], str(10_000)], env, tmp / "held", args.repeats
            )
        finally:
            server.stop()
    results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print_table(results, args.epochs, args.repeats)
    print_commands(commands, args.repeats)


def time_commands(py: str, ckptflow: str, store: Path, repeats: int) -> dict[str, float]:
    """Median seconds of each inspection command, and of importing torch, each in a fresh process."""
    cmds = {
        "python -c 'import torch'": [py, "-c", "import torch"],
        "ckptflow ls": [ckptflow, "ls", str(store)],
        "ckptflow show": [ckptflow, "show", str(store)],
        "ckptflow verify": [ckptflow, "verify", str(store)],
    }
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(repeats):
        for name, cmd in cmds.items():
            start = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def time_refusal(run_cmd: list[str], env: dict[str, str], store: Path, repeats: int) -> float:
    """Median seconds a second ``ckptflow run`` takes to be refused on a store a running one holds."""
    env = {**env, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [*run_cmd, "--storage", str(store)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (store / "lease.json").exists():
            if holder.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the holding run did not take the lease")
            time.sleep(0.1)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            done = subprocess.run([*run_cmd, "--storage", str(store)], env=env, cwd=ROOT, capture_output=True)
            times.append(time.perf_counter() - start)
            if done.returncode != 75:
                raise SystemExit(
                    f"the second run was not refused (exit {done.returncode}): {done.stderr[-2000:]!r}"
                )
        return statistics.median(times)
    finally:
        holder.terminate()
        holder.wait(120)


def print_commands(commands: dict[str, float], repeats: int) -> None:
    floor = commands["python -c 'import torch'"]
    rows = [[name, f"{s:.2f}", f"{s / floor:.2f}x"] for name, s in commands.items()]
    print(f"\ninspection commands on the run's store, median of {repeats}\n")
    print(markdown_table(["command", "seconds", "vs importing torch"], "lrr", rows))


KINDS = (
    "plain loop",
    "plain loop as a Prefect flow, server",
    "prefect floor, ephemeral",
    "ckptflow run, ephemeral",
    "prefect floor, server",
    "ckptflow run, server",
    "ckptflow run --in-process, server",
    "plain loop, 2 ranks (torchrun)",
    "plain loop as a Prefect flow, 2 ranks, server",
    "ckptflow run --nproc 2, server",
)


def print_table(results: dict[str, dict[str, float]], epochs: int, repeats: int) -> None:
    plain1 = results["plain loop"]["epochs"]
    plain2 = results["plain loop, 2 ranks (torchrun)"]["epochs"]
    print(
        f"\n{epochs} epochs of the digits demo, a save every epoch; median of {repeats} runs, {machine()}\n"
    )
    rows = []
    for name, r in results.items():
        plain = plain2 if "2 ranks" in name else plain1  # against the plain loop of the same world size
        per_epoch = "" if "floor" in name else f"{1000 * (r['epochs'] - plain) / epochs:.1f}"
        epochs_s = "" if "floor" in name else f"{r['epochs']:.2f}"
        rows.append([name, f"{r['to_first_epoch']:.2f}", epochs_s, per_epoch])
    header = ["run", "start -> first epoch (s)", "epochs (s)", "overhead per epoch vs plain (ms)"]
    print(markdown_table(header, "lrrr", rows))
    eph = (
        results["ckptflow run, ephemeral"]["to_first_epoch"]
        - results["prefect floor, ephemeral"]["to_first_epoch"]
    )
    srv = results["ckptflow run, server"]["to_first_epoch"]
    print(f"\nstart-up above Prefect's floor (ephemeral): {eph:.2f} s (target <= 2 s)")
    inp = results["ckptflow run --in-process, server"]["to_first_epoch"]
    print(f"start-up against a running server: {srv:.2f} s (target <= 4 s); in-process {inp:.2f} s")
    print(f"the training process's start-up against in-process: {srv / inp:.2f}x the time")
    for world, plain_name, tasks_name, run_name in (
        (1, "plain loop", "plain loop as a Prefect flow, server", "ckptflow run, server"),
        (
            2,
            "plain loop, 2 ranks (torchrun)",
            "plain loop as a Prefect flow, 2 ranks, server",
            "ckptflow run --nproc 2, server",
        ),
    ):
        p, c = results[plain_name], results[run_name]
        later = c["to_first_epoch"] - p["to_first_epoch"]
        overhead = 1000 * (c["epochs"] - p["epochs"]) / epochs
        floor = 1000 * (results[tasks_name]["epochs"] - p["epochs"]) / epochs
        print(
            f"W={world}: first epoch {later:+.2f} s after the plain loop's (target <= 0.5 s); "
            f"orchestration {overhead:.1f} ms per epoch (target <= 30 ms); "
            f"the plain loop as a Prefect flow (two empty tasks per epoch): {floor:.1f} ms"
        )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
