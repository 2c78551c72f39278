"""Step checkpoints: what a save every N steps costs a training loop, on the shapes users train.

For each model shape (a transformer + AdamW, a CNN with BatchNorm + SGD momentum,
a many-expert MoE + AdamW, thousands of small tensors, a 3 MB state), a real
training loop (forward, backward, optimizer step on random data) runs ``--steps``
steps and saves every ``--every`` steps, several ways, interleaved, ``--repeats``
times each (medians shown):

- ``none``: no saves, the loop's own time;
- ``torch.save``: ``torch.save`` of the state dict to a file, fsynced, in the loop;
- ``DCP async_save``: ``torch.distributed.checkpoint.async_save`` (one process), each
  save waited for before the next starts, as DCP's docs advise;
- ``ckptflow save_async``: ``CheckpointStore.save_async`` (staged copy, then a
  background write and commit), the pipeline's save;
- ``copy``: the floor of any snapshot: each tensor copied into a preallocated
  tensor of its shape, whose pages were touched already (no file).

Columns: the time the loop is blocked per save (the call's return; for async
saves the staging), the loop's extra time per save against ``none`` (blocking
plus the background write's contention for the cores), and the blocked time
against the ``copy`` floor (target: ckptflow <= 1.5x).

A second table measures the pipeline's orchestration per save point: ``ckptflow
run --in-process`` on the digits demo (12 steps an epoch) with a save point at
every step against the same run with saves at epoch ends only, minus what the
saves themselves cost outside Prefect (target: <= 30 ms a save point).

    .venv/bin/python bench/bench_steps.py [--steps 40] [--every 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import disk_temp_dir, fsync_path, load_average, machine, markdown_table  # noqa: E402

MiB = 1 << 20


# -- the shapes -------------------------------------------------------------------------------------


class MoE(nn.Module):
    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            mask = top == i
            if mask.any():
                out[mask] = expert(x[mask])
        return out + x


class Small(nn.Module):
    """Thousands of small tensors: 1,000 tiny layers (2,000 parameters; 8,000 tensors with AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def shapes() -> dict[str, Callable[[], tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]]]:
    def transformer():  # type: ignore[no-untyped-def]
        model = nn.TransformerEncoder(nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True), 6)
        return (
            model,
            torch.optim.AdamW(model.parameters()),
            lambda: model(torch.randn(4, 32, 512)).square().mean(),
        )

    def cnn():  # type: ignore[no-untyped-def]
        layers: list[nn.Module] = []
        width = 3
        for out in (64, 128, 256, 512, 512):
            layers += [nn.Conv2d(width, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
            width = out
        model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(512, 1000))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return model, opt, lambda: model(torch.randn(8, 3, 32, 32)).square().mean()

    def moe():  # type: ignore[no-untyped-def]
        model = MoE(256, 64)
        return (
            model,
            torch.optim.AdamW(model.parameters()),
            lambda: model(torch.randn(64, 256)).square().mean(),
        )

    def small():  # type: ignore[no-untyped-def]
        model = Small()
        return model, torch.optim.AdamW(model.parameters()), lambda: model(torch.randn(4, 8)).square().mean()

    def tiny():  # type: ignore[no-untyped-def]
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))  # ~3 MB with AdamW
        return (
            model,
            torch.optim.AdamW(model.parameters()),
            lambda: model(torch.randn(32, 256)).square().mean(),
        )

    return {
        "transformer + AdamW": transformer,
        "CNN + BatchNorm": cnn,
        "MoE, 64 experts": moe,
        "8,000 small tensors": small,
        "3 MB state": tiny,
    }


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors(v)]
    return []


# -- the ways to save -------------------------------------------------------------------------------


class Way:
    """A way to save in the loop: ``save(state, n)`` blocks the loop for what it returns; ``end()``
    waits for what goes on in the background."""

    def __init__(self, work: Path) -> None:
        self.work = work

    def save(self, state: dict[str, Any], n: int) -> None:
        raise NotImplementedError

    def end(self) -> None:
        return None


class NoSave(Way):
    def save(self, state: dict[str, Any], n: int) -> None:
        return None


class TorchSave(Way):
    def save(self, state: dict[str, Any], n: int) -> None:
        path = self.work / f"step-{n}.pt"
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.work)


class DcpAsync(Way):
    def __init__(self, work: Path) -> None:
        super().__init__(work)
        self.pending: Any = None

    def save(self, state: dict[str, Any], n: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.pending is not None:
            self.pending.result()
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # one process: "assuming the intent is to save in a single process"
            self.pending = dcp.async_save(state, checkpoint_id=str(self.work / f"step-{n}"))

    def end(self) -> None:
        if self.pending is not None:
            self.pending.result()


class Ckptflow(Way):
    def __init__(self, work: Path) -> None:
        super().__init__(work)
        from ckptflow.storage import CheckpointStore

        self.store = CheckpointStore(str(work / "store"))

    def save(self, state: dict[str, Any], n: int) -> None:
        self.store.save_async(state, step=n, version=n)  # numbered, as the pipeline saves

    def end(self) -> None:
        self.store.wait()
        self.store.close()


class Copy(Way):
    def __init__(self, work: Path) -> None:
        super().__init__(work)
        self.into: list[torch.Tensor] | None = None

    def save(self, state: dict[str, Any], n: int) -> None:
        sources = tensors(state)
        if self.into is None:  # allocated and touched once, outside the timing of later saves
            self.into = [torch.empty_like(t).copy_(t) for t in sources]
            return
        for dst, src in zip(self.into, sources, strict=True):
            dst.copy_(src)


WAYS: dict[str, type[Way]] = {
    "none": NoSave,
    "torch.save": TorchSave,
    "DCP async_save": DcpAsync,
    "ckptflow save_async": Ckptflow,
    "copy": Copy,
}


def loop(
    build: Callable[[], Any], way_kind: type[Way], steps: int, every: int, root: Path
) -> tuple[float, list[float]]:
    """(the loop's seconds, the seconds each save blocked it): a fresh model, a fresh store."""
    torch.manual_seed(0)
    model, opt, loss_of = build()
    work = Path(tempfile.mkdtemp(dir=root))
    way = way_kind(work)
    blocked: list[float] = []
    try:
        started = time.perf_counter()
        for step in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            loss_of().backward()
            opt.step()
            if step % every == 0:
                t = time.perf_counter()
                way.save(state_of(model, opt), step)
                blocked.append(time.perf_counter() - t)
        way.end()
        return time.perf_counter() - started, blocked
    finally:
        shutil.rmtree(work, ignore_errors=True)


def state_mib(build: Callable[[], Any]) -> tuple[float, int]:
    model, opt, loss_of = build()
    loss_of().backward()
    opt.step()
    found = tensors(state_of(model, opt))
    return sum(t.numel() * t.element_size() for t in found) / MiB, len(found)


# -- orchestration per save point --------------------------------------------------------------------


def pipeline_seconds(root: Path, every_steps: int | None, epochs: int) -> float:
    """Seconds from the first step to the end of the last epoch of ``ckptflow run --in-process``."""
    times = root / f"times-{every_steps}-{time.monotonic_ns()}"
    store = root / f"run-{every_steps}-{time.monotonic_ns()}"
    cmd = [
        str(Path(sys.executable).parent / "ckptflow"),
        "run",
        "--storage",
        str(store),
        "--spec",
        "bench.timing_spec:TimedSteppedDigits",
        "--epochs",
        str(epochs),
        "--in-process",
    ]
    if every_steps:
        cmd += ["--save-every-steps", str(every_steps)]
    env = {**os.environ, "CKPTFLOW_BENCH_TIMES": str(times), "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
    marks = [line.split() for line in times.read_text().splitlines()]
    first = min(float(t) for name, t in marks if name == "first_step")
    last = max(float(t) for name, t in marks if name == "epoch_end")
    shutil.rmtree(store, ignore_errors=True)
    times.unlink()
    return last - first


FLOOR = r"""
import sys, time
from prefect import flow, task

@task
def stretch(n): return n

@task
def save(n): return n

@flow
def points(count):
    stretch(0), save(0)  # the first task runs of a process are slower: not counted
    started = time.perf_counter()
    for n in range(count):
        stretch(n)
        save(n)
    return (time.perf_counter() - started) / count

print("FLOOR", points(int(sys.argv[1])))
"""


def prefect_floor_seconds(points: int) -> float:
    """Prefect's own cost of a save point's two task runs: a flow of two empty tasks per point,
    with the API ``ckptflow run`` uses here (its temporary server)."""
    out = subprocess.run(
        [sys.executable, "-c", FLOOR, str(points)], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith("FLOOR")))


def digits_save_seconds(root: Path, saves: int) -> float:
    """What a save of the digits demo's state costs outside Prefect (save_async, waited for)."""
    from ckptflow.flows.demo import DigitsSpec
    from ckptflow.storage import CheckpointStore
    from ckptflow.tasks.training.training_state import capture

    spec = DigitsSpec({}, seed=0)
    trainable = spec.build()
    store = CheckpointStore(str(root / f"digits-{time.monotonic_ns()}"))
    started = time.perf_counter()
    for n in range(saves):
        store.save_async(capture(trainable, spec, epoch=0, step=n), step=n)
    store.wait()
    took = (time.perf_counter() - started) / saves
    store.close()
    shutil.rmtree(store.url, ignore_errors=True)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="epochs of the orchestration runs")
    parser.add_argument("--only", default="", help="comma-separated shape names (default: all)")
    parser.add_argument("--skip-pipeline", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    root = Path(tempfile.mkdtemp(prefix="ckptflow-bench-steps-", dir=disk_temp_dir()))
    saves = args.steps // args.every
    rows = []
    try:
        for name, build in shapes().items():
            if args.only and name not in args.only.split(","):
                continue
            mib, count = state_mib(build)
            runs: dict[str, list[tuple[float, list[float]]]] = {w: [] for w in WAYS}
            for _ in range(args.repeats):
                for way, kind in WAYS.items():  # interleaved: the disk's and the machine's drift hit all
                    runs[way].append(loop(build, kind, args.steps, args.every, root))
            base = statistics.median(t for t, _ in runs["none"])
            blocked = {w: statistics.median(b for _, bs in runs[w] for b in bs[1:] or bs) for w in WAYS}
            floor = blocked["copy"]
            for way in ("torch.save", "DCP async_save", "ckptflow save_async", "copy"):
                extra = (statistics.median(t for t, _ in runs[way]) - base) / saves
                rows.append(
                    [
                        name if way == "torch.save" else "",
                        f"{mib:.1f} MiB, {count:,} tensors" if way == "torch.save" else "",
                        way,
                        f"{blocked[way] * 1e3:.1f}",
                        f"{extra * 1e3:.1f}",
                        f"{blocked[way] / floor:.2f}x" if floor > 0 else "-",
                    ]
                )
        print(f"# Step checkpoints ({machine()}; load {load_average()})")
        print(
            f"{args.steps} training steps, a save every {args.every}; "
            f"medians of {args.repeats} interleaved runs"
        )
        print()
        header = [
            "shape",
            "state",
            "save",
            "loop blocked per save (ms)",
            "loop's extra time per save (ms)",
            "blocked / copy",
        ]
        print(markdown_table(header, "llllrr", rows))
        if not args.skip_pipeline:
            print()
            per_step = [pipeline_seconds(root, 1, args.epochs) for _ in range(args.repeats)]
            epoch_only = [pipeline_seconds(root, None, args.epochs) for _ in range(args.repeats)]
            points = args.epochs * 12 - args.epochs  # save points inside epochs (epoch ends are in both)
            save = digits_save_seconds(root, 20)
            floor = statistics.median(prefect_floor_seconds(points) for _ in range(args.repeats))
            extra = (statistics.median(per_step) - statistics.median(epoch_only)) / points
            print(
                "Orchestration per save point: `ckptflow run --in-process` on the digits demo, "
                f"{args.epochs} epochs of 12 steps"
            )
            print()
            print(
                markdown_table(
                    ["run", "first step to end (s)", "per save point (ms)"],
                    "lrr",
                    [
                        ["saves at epoch ends", f"{statistics.median(epoch_only):.2f}", ""],
                        [
                            "a save point every step",
                            f"{statistics.median(per_step):.2f}",
                            f"{extra * 1e3:.1f}",
                        ],
                        ["  of which the save itself (outside Prefect)", "", f"{save * 1e3:.1f}"],
                        ["  orchestration (the rest)", "", f"{(extra - save) * 1e3:.1f}"],
                        ["Prefect's floor: two empty task runs", "", f"{floor * 1e3:.1f}"],
                    ],
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
