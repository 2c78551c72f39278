"""Incremental checkpoints: bytes written, store size, save and load time of content-addressed saves.

Three runs of successive saves, each state built from a fixed seed:

- ``frozen-base``: a fine-tune. GPT-2 small's layout (token and position
  embeddings, 12 blocks of layer norms, ``c_attn``, ``c_proj``, ``c_fc``,
  ``c_proj``; widths times ``--scale``, default 0.5: about 125 MiB) is the
  frozen base; LoRA adapters of rank 8 on every ``c_attn`` and ``c_fc``
  and a classification head are trained, with ``torch.optim.AdamW``'s state
  (a real step between saves). The base is more than 90% of the bytes;
- ``dense``: the same layout at ``--dense-scale`` (default 0.25), every
  parameter trained by AdamW: everything changes between saves;
- ``unchanged``: the frozen-base state saved 6 times without a step.

Methods, each writing to a real disk and ending with its files fsynced: ckptflow
(content-addressed, the default), ckptflow ``StoreOptions(dedup=False)`` (every
version a full copy), ckptflow through ``dcp.save(storage_writer=store.dcp_writer())``
(the sharded save path, in one process), ``torch.save`` + fsync (a new file per save), DCP ``save``
(``FileSystemWriter(sync_files=True)``, a new directory per save).

Per method: the bytes each save wrote (median over the saves after the first),
the store's size after all saves, the save's time (median over the saves after
the first; the methods take turns at each save, in a rotating order, with
``os.sync()`` untimed before each), and the load time of the last
version (median of ``--repeats``; ckptflow verifies every checksum; torch.load
``weights_only=True``; DCP into a preallocated state). "changed" is the bytes of
the tensors that differ from the previous save; "unique" the bytes of all the
distinct tensors of every save.

Targets (issue "Incremental checkpoints"): frozen-base: bytes written per save at most
1.1x the changed bytes, the store at most 1.2x the unique bytes, the save at most
0.3x ckptflow's full save (dedup off); dense: ckptflow's save within 3% of the full
save, its load the same; unchanged: the second save writes at most 1% of its bytes.

Run: ``.venv/bin/python bench/bench_incremental.py [--saves 20] [--dense-saves 5]
[--repeats 5] [--scale 0.5]``; a smoke test: ``--scale 0.05 --dense-scale 0.05 --saves 3
--dense-saves 2 --repeats 1``.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import disk_temp_dir, emit, fsync_path, load_average, machine, markdown_table
from ckptflow.storage import CheckpointStore, StoreOptions

MiB = 1 << 20


# -- the states ---------------------------------------------------------------------------------------


def gpt2_layout(scale: float) -> list[tuple[str, tuple[int, ...]]]:
    d, vocab, positions = max(8, int(768 * scale)), max(16, int(50257 * scale)), max(8, int(1024 * scale))
    layout = [("wte.weight", (vocab, d)), ("wpe.weight", (positions, d))]
    for i in range(12):
        p = f"h.{i}."
        layout += [
            (p + "ln_1.weight", (d,)),
            (p + "ln_1.bias", (d,)),
            (p + "attn.c_attn.weight", (d, 3 * d)),
            (p + "attn.c_attn.bias", (3 * d,)),
            (p + "attn.c_proj.weight", (d, d)),
            (p + "attn.c_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)),
            (p + "ln_2.bias", (d,)),
            (p + "mlp.c_fc.weight", (d, 4 * d)),
            (p + "mlp.c_fc.bias", (4 * d,)),
            (p + "mlp.c_proj.weight", (4 * d, d)),
            (p + "mlp.c_proj.bias", (d,)),
        ]
    return [*layout, ("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


class Run:
    """A training run whose ``state()`` is saved after each ``step()``."""

    def __init__(self, scale: float, *, frozen: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        self.base = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in gpt2_layout(scale)}
        self.frozen = frozen
        d = self.base["ln_f.weight"].numel()
        if frozen:
            self.trained: dict[str, torch.nn.Parameter] = {}
            for i in range(12):
                for layer, width in (("attn.c_attn", 3 * d), ("mlp.c_fc", 4 * d)):
                    self.trained[f"h.{i}.{layer}.lora_A"] = torch.nn.Parameter(
                        torch.randn(d, 8, generator=gen) * 0.01
                    )
                    self.trained[f"h.{i}.{layer}.lora_B"] = torch.nn.Parameter(torch.zeros(8, width))
            self.trained["head.weight"] = torch.nn.Parameter(torch.randn(2, d, generator=gen) * 0.02)
        else:
            self.trained = {name: torch.nn.Parameter(t) for name, t in self.base.items()}
        self.opt = torch.optim.AdamW(self.trained.values(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(1)
        self.step()

    def step(self) -> None:
        for p in self.trained.values():
            p.grad = torch.randn(p.shape, generator=self.gen) * 0.01
        self.opt.step()

    def state(self) -> dict[str, Any]:
        model = (
            {**self.base, **{k: p.detach() for k, p in self.trained.items()}}
            if self.frozen
            else {k: p.detach() for k, p in self.trained.items()}
        )
        return {"model": model, "optimizer": self.opt.state_dict()}


def tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in tensors(value, f"{prefix}/{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in tensors(value, f"{prefix}/{i}").items()}
    return {}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy (the run changes its tensors in place)."""
    return copy.deepcopy(state)


# -- the methods ----------------------------------------------------------------------------------------


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Method:
    name: str

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True)

    def save(self, state: dict[str, Any], n: int) -> None:
        raise NotImplementedError

    def load(self, n: int, like: dict[str, Any]) -> object:
        raise NotImplementedError


class Ckptflow(Method):
    def __init__(self, root: Path, *, dedup: bool) -> None:
        super().__init__(root)
        self.name = "ckptflow" if dedup else "ckptflow, dedup off"
        self.store = CheckpointStore(root / "store", options=StoreOptions(dedup=dedup))

    def save(self, state: dict[str, Any], n: int) -> None:
        self.store.save(state, version=n)

    def load(self, n: int, like: dict[str, Any]) -> object:
        return CheckpointStore(self.root / "store").load(version=n)


class CkptflowDcp(Method):
    """ckptflow's sharded save path: DCP's planner, ckptflow's writer (``store.dcp_writer()``)."""

    name = "ckptflow, `dcp.save`"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.store = CheckpointStore(root / "store")

    def save(self, state: dict[str, Any], n: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=self.store.dcp_writer(version=n), no_dist=True)

    def load(self, n: int, like: dict[str, Any]) -> object:
        return CheckpointStore(self.root / "store").load(version=n)


class TorchSave(Method):
    name = "`torch.save` + fsync"

    def save(self, state: dict[str, Any], n: int) -> None:
        path = self.root / f"{n}.pt"
        torch.save(state, path)
        fsync_path(path)
        fsync_path(self.root)

    def load(self, n: int, like: dict[str, Any]) -> object:
        return torch.load(self.root / f"{n}.pt", weights_only=True)


class Dcp(Method):
    name = "DCP `save`"

    def save(self, state: dict[str, Any], n: int) -> None:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(str(self.root / str(n)), sync_files=True)
        dcp.save(state, storage_writer=writer, no_dist=True)
        fsync_path(self.root / str(n))

    def load(self, n: int, like: dict[str, Any]) -> object:
        import torch.distributed.checkpoint as dcp

        target = snapshot(like)
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(self.root / str(n))), no_dist=True)
        return target


METHODS: list[Callable[[Path], Method]] = [
    lambda root: Ckptflow(root, dedup=True),
    lambda root: Ckptflow(root, dedup=False),
    CkptflowDcp,
    TorchSave,
    Dcp,
]


# -- measuring ----------------------------------------------------------------------------------------


def measure(kind: str, make: Callable[[], Run], saves: int, repeats: int, work: Path) -> list[dict[str, Any]]:
    """Every method on the same sequence of states (built once, copied)."""
    run = make()
    states = []
    for _ in range(saves):
        states.append(snapshot(run.state()))
        if kind != "unchanged":
            run.step()
    changed, unique = [], {}
    for i, state in enumerate(states):
        flat = tensors(state)
        for t in flat.values():
            unique.setdefault(t.numel() and hash(t.numpy().tobytes()), nbytes(t))
        if i:
            before = tensors(states[i - 1])
            changed.append(
                sum(nbytes(t) for k, t in flat.items() if not torch.equal(t, before.get(k, t.new_empty(0))))
            )
    total = sum(nbytes(t) for t in tensors(states[0]).values())
    roots = []
    for make_method in METHODS:
        root = Path(tempfile.mkdtemp(dir=work, prefix="incr-"))
        shutil.rmtree(root)
        roots.append(make_method(root))
    written: dict[str, list[int]] = {m.name: [] for m in roots}
    times: dict[str, list[float]] = {m.name: [] for m in roots}
    for i, state in enumerate(states):  # the methods take turns, in a rotating order
        for method in roots[i % len(roots) :] + roots[: i % len(roots)]:
            os.sync()
            before = dir_bytes(method.root)
            start = time.perf_counter()
            method.save(state, i)
            times[method.name].append(time.perf_counter() - start)
            written[method.name].append(dir_bytes(method.root) - before)
    rows = []
    for method in roots:
        loads = []
        for _ in range(repeats):
            start = time.perf_counter()
            method.load(saves - 1, states[-1])
            loads.append(time.perf_counter() - start)
        rows.append(
            {
                "kind": kind,
                "method": method.name,
                "state": total,
                "changed": statistics.median(changed) if changed else 0,
                "unique": sum(unique.values()),
                "written": statistics.median(written[method.name][1:]),
                "store": dir_bytes(method.root),
                "save": statistics.median(times[method.name][1:]),
                "load": statistics.median(loads),
            }
        )
        shutil.rmtree(method.root)
    return rows


def mib(n: float) -> str:
    return f"{n / MiB:.2f}"


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    full = {r["kind"]: r for r in rows if r["method"] == "ckptflow, dedup off"}
    table = markdown_table(
        [
            "run",
            "method",
            "written per save (MiB)",
            "vs changed",
            "store after all (MiB)",
            "vs unique",
            "save (s)",
            "vs full save",
            "load (s)",
        ],
        "llrrrrrrr",
        [
            [
                r["kind"],
                r["method"],
                mib(r["written"]),
                f"{r['written'] / r['changed']:.2f}x" if r["changed"] else "-",
                mib(r["store"]),
                f"{r['store'] / r['unique']:.2f}x",
                f"{r['save']:.4f}",
                f"{r['save'] / full[r['kind']]['save']:.2f}x",
                f"{r['load']:.4f}",
            ]
            for r in rows
        ],
    )
    states = {r["kind"]: r for r in rows if r["method"] == "ckptflow"}
    lines = [
        f"# Incremental checkpoints ({machine()}; load {load_average()})",
        "",
        f"frozen-base: {args.saves} saves of {mib(states['frozen-base']['state'])} MiB, "
        f"{mib(states['frozen-base']['changed'])} MiB changed per save; dense: {args.dense_saves} saves "
        f"of {mib(states['dense']['state'])} MiB; unchanged: 6 saves of one state.",
        "",
        table,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--dense-saves", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--dense-scale", type=float, default=0.25)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(dir=args.dir or disk_temp_dir(), prefix="bench-incremental-"))
    try:
        rows = measure("frozen-base", lambda: Run(args.scale, frozen=True), args.saves, args.repeats, work)
        rows += measure(
            "dense", lambda: Run(args.dense_scale, frozen=False), args.dense_saves, args.repeats, work
        )
        rows += measure("unchanged", lambda: Run(args.scale, frozen=True), 6, args.repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(report(rows, args), args.markdown)


if __name__ == "__main__":
    main()
