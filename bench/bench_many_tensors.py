"""Many tensors: ckptflow's save and load against torch, safetensors and DCP, on six shapes of state.

Where the bytes are few and the tensors many, what a save or a load does per
tensor decides the time. The shapes, each built from a fixed seed:

- ``tensors-1k``, ``tensors-20k``, ``tensors-100k``: 1,000 / 20,000 / 100,000
  float32 tensors of 64 elements (``layers.{i}.weight``);
- ``transformer+AdamW``: GPT-2 small's layout (token and position embeddings,
  12 blocks of layer norms, ``c_attn``, ``c_proj``, ``c_fc``, ``c_proj``, the
  final layer norm, the tied ``lm_head`` left out; 124M parameters at full
  width, 1.4 GiB with the optimizer state) with the ``state_dict`` of
  ``torch.optim.AdamW`` after one step, its widths (vocabulary, positions,
  d_model) times ``--transformer-scale`` (default 0.5: a quarter of the bytes);
- ``CNN+BN+SGD``: ResNet-50's layout (bottleneck blocks [3, 4, 6, 3], downsample
  conv + BatchNorm, BatchNorm running stats and ``num_batches_tracked``, fc
  2048 x 1000: 320 tensors, 25.6M parameters) with SGD momentum buffers after one step;
- ``MoE+Adam``: a fine-grained mixture of experts (16 layers of attention, a
  router and 64 experts of w1/w2/w3 with d=256, f=32: 3,186 tensors, 115 MiB)
  with the ``state_dict`` of ``torch.optim.Adam`` after one step.

A model's state is ``{"model": ..., "optimizer": optimizer.state_dict()}``; the
optimizer state comes from a real step on ``nn.Parameter`` made from the model's
tensors, with a random gradient. ``--scale`` multiplies the tensor counts of the
``tensors-*`` shapes and the widths of the model shapes (layers, blocks and
experts stay), for smoke tests.

Methods, each writing to a real disk (never tmpfs) and ending with its files and
their directory fsynced:

- save, the first of a fresh process: ckptflow ``CheckpointStore(dir).save(state,
  epoch=1)`` (opening the new store included) against ``torch.save`` + fsync, each
  timed alone in a new process that imported torch (and ckptflow) and built the
  state first; median over ``--samples`` processes, the two methods taking turns.
  ckptflow's modules are compiled to bytecode first, as installing a package leaves
  them (a source tree run with ``PYTHONDONTWRITEBYTECODE`` set would compile the
  modules of a save in every fresh process: about 12 ms more);
- save, in one process, median of ``--repeats``, every tensor changed (untimed) before each
  save, as a training step changes them: ckptflow ``save`` into a store
  that holds one earlier version of the state (one untimed save first; older
  versions pruned between saves, untimed), ``torch.save`` + fsync (a new file each
  time), safetensors ``save_file`` + fsync (the state flattened to dotted keys;
  non-tensor leaves such as ``param_groups`` go into the file's metadata as JSON),
  DCP ``save`` (``FileSystemWriter(thread_count=1, sync_files=True)``,
  ``no_dist=True``, a new directory each time); ``os.sync()`` runs, untimed,
  before every timed save;
- load, in one process, median of ``--repeats`` after one untimed load whose
  tensors are checked against the state: ckptflow ``load()`` (every blob checked
  against its checksum) and ``load(verify=False)``, ``torch.load(weights_only=True)``,
  safetensors ``load_file`` (the flat dict, metadata not parsed), DCP ``load`` into
  a preallocated state of the same structure. The files were just written and read
  once, so every load reads the page cache alike: the loads measure the software,
  not the disk.

"vs torch" is torch's seconds over the row's (above 1: faster than torch), against
``torch.save`` + fsync for saves (for the first-save rows: in a fresh process too)
and ``torch.load(weights_only=True)`` for loads. Targets: ckptflow's saves (the
first of a process and later ones) and loads at least 1.2x torch; at 100,000
tensors within 2x of torch (at least 0.5x).

Run: ``.venv/bin/python bench/bench_many_tensors.py [--shapes tensors-1k,MoE+Adam] [--repeats 5]
[--samples 5] [--transformer-scale 0.5]``; a smoke test: ``--scale 0.02 --repeats 2 --samples 2``.
Most of a default run goes to ``tensors-100k`` (DCP above all) and to the 2 x ``--samples``
fresh processes of each shape, each importing torch and building the state.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file or with -m

from bench.common import (
    MiB,
    disk_temp_dir,
    emit,
    fsync_path,
    load_average,
    machine,
    markdown_table,
    median_seconds,
    seconds,
)
from ckptflow.storage import CheckpointStore

SMALL_NUMEL = 64
TENSOR_COUNTS = {"tensors-1k": 1_000, "tensors-20k": 20_000, "tensors-100k": 100_000}
GPT2_BLOCKS = 12
RESNET50_STAGES = ((3, 64), (4, 128), (6, 256), (3, 512))  # (bottleneck blocks, width)
MOE_LAYERS, MOE_EXPERTS = 16, 64

Optimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# -- the shapes --------------------------------------------------------------------------------------


def scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def small_tensors(count: int) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": torch.randn(SMALL_NUMEL) for i in range(count)}


def trained_state(
    model: dict[str, torch.Tensor], trainable: list[str], optimizer: Optimizer
) -> dict[str, Any]:
    """The model and its optimizer's ``state_dict`` after one step with a random gradient."""
    params = [nn.Parameter(model[name]) for name in trainable]  # shares the model's tensors
    opt = optimizer(params)
    for p in params:
        p.grad = torch.randn_like(p).mul_(1e-3)
    opt.step()
    return {"model": model, "optimizer": opt.state_dict()}


def layer_norm(name: str, d: int) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": torch.randn(d), f"{name}.bias": torch.randn(d)}


def conv1d(name: str, n_in: int, n_out: int) -> dict[str, torch.Tensor]:
    """GPT-2's ``Conv1D``: a linear layer whose weight is (in, out)."""
    return {f"{name}.weight": torch.randn(n_in, n_out), f"{name}.bias": torch.randn(n_out)}


def gpt2_block(prefix: str, d: int) -> dict[str, torch.Tensor]:
    return {
        **layer_norm(f"{prefix}.ln_1", d),
        **conv1d(f"{prefix}.attn.c_attn", d, 3 * d),
        **conv1d(f"{prefix}.attn.c_proj", d, d),
        **layer_norm(f"{prefix}.ln_2", d),
        **conv1d(f"{prefix}.mlp.c_fc", d, 4 * d),
        **conv1d(f"{prefix}.mlp.c_proj", 4 * d, d),
    }


def gpt2_model(scale: float) -> dict[str, torch.Tensor]:
    d, vocab, positions = scaled(768, scale), scaled(50_257, scale), scaled(1024, scale)
    model = {
        "transformer.wte.weight": torch.randn(vocab, d),
        "transformer.wpe.weight": torch.randn(positions, d),
    }
    for i in range(GPT2_BLOCKS):
        model |= gpt2_block(f"transformer.h.{i}", d)
    return model | layer_norm("transformer.ln_f", d)


def conv(name: str, n_out: int, n_in: int, kernel: int) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": torch.randn(n_out, n_in, kernel, kernel)}


def batch_norm(name: str, n: int) -> dict[str, torch.Tensor]:
    return {
        f"{name}.weight": torch.randn(n),
        f"{name}.bias": torch.randn(n),
        f"{name}.running_mean": torch.randn(n),
        f"{name}.running_var": torch.rand(n),
        f"{name}.num_batches_tracked": torch.tensor(1),  # an int64 scalar
    }


def bottleneck(prefix: str, n_in: int, width: int, downsample: bool) -> dict[str, torch.Tensor]:
    n_out = 4 * width
    block = {
        **conv(f"{prefix}.conv1", width, n_in, 1),
        **batch_norm(f"{prefix}.bn1", width),
        **conv(f"{prefix}.conv2", width, width, 3),
        **batch_norm(f"{prefix}.bn2", width),
        **conv(f"{prefix}.conv3", n_out, width, 1),
        **batch_norm(f"{prefix}.bn3", n_out),
    }
    if downsample:
        block |= conv(f"{prefix}.downsample.0", n_out, n_in, 1) | batch_norm(f"{prefix}.downsample.1", n_out)
    return block


def resnet50_model(scale: float) -> dict[str, torch.Tensor]:
    channels = scaled(64, scale)
    model = conv("conv1", channels, 3, 7) | batch_norm("bn1", channels)
    for stage, (blocks, width) in enumerate(RESNET50_STAGES, start=1):
        for block in range(blocks):
            model |= bottleneck(
                f"layer{stage}.{block}", channels, scaled(width, scale), downsample=block == 0
            )
            channels = 4 * scaled(width, scale)
    classes = scaled(1000, scale)
    return model | {"fc.weight": torch.randn(classes, channels), "fc.bias": torch.randn(classes)}


def moe_model(scale: float) -> dict[str, torch.Tensor]:
    d, f, vocab = scaled(256, scale), scaled(32, scale), scaled(2048, scale)
    model = {"embed.weight": torch.randn(vocab, d)}
    for i in range(MOE_LAYERS):
        prefix = f"layers.{i}"
        model[f"{prefix}.attention_norm.weight"] = torch.randn(d)
        model |= {f"{prefix}.attention.{w}.weight": torch.randn(d, d) for w in ("wq", "wk", "wv", "wo")}
        model[f"{prefix}.ffn_norm.weight"] = torch.randn(d)
        model[f"{prefix}.moe.router.weight"] = torch.randn(MOE_EXPERTS, d)
        for e in range(MOE_EXPERTS):
            expert = f"{prefix}.moe.experts.{e}"
            model |= {f"{expert}.w1": torch.randn(d, f), f"{expert}.w2": torch.randn(f, d)}
            model[f"{expert}.w3"] = torch.randn(d, f)
    return model | {"norm.weight": torch.randn(d)}


def gpt2_adamw(scale: float) -> dict[str, Any]:
    model = gpt2_model(scale)
    return trained_state(model, list(model), functools.partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.1))


def resnet50_sgd(scale: float) -> dict[str, Any]:
    model = resnet50_model(scale)
    trainable = [name for name in model if name.endswith((".weight", ".bias"))]  # not the BN buffers
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-4)
    return trained_state(model, trainable, sgd)


def moe_adam(scale: float) -> dict[str, Any]:
    model = moe_model(scale)
    return trained_state(model, list(model), functools.partial(torch.optim.Adam, lr=1e-4))


MODELS: dict[str, Callable[[float], dict[str, Any]]] = {
    "transformer+AdamW": gpt2_adamw,
    "CNN+BN+SGD": resnet50_sgd,
    "MoE+Adam": moe_adam,
}
SHAPES = [*TENSOR_COUNTS, *MODELS]


def shape_scale(shape: str, args: argparse.Namespace) -> float:
    return args.scale * (args.transformer_scale if shape == "transformer+AdamW" else 1.0)


def build_state(shape: str, scale: float) -> dict[str, Any]:
    torch.manual_seed(0)
    if shape in TENSOR_COUNTS:
        return small_tensors(scaled(TENSOR_COUNTS[shape], scale))
    return MODELS[shape](scale)


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key path, value) of every leaf under the dicts of a state (lists are leaves)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, tree


def flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    return {key: value for key, value in leaves(state) if isinstance(value, torch.Tensor)}


def change(state: dict[str, Any]) -> None:
    """Change every tensor of the state in place (untimed, before each timed save): a training
    step changes them, and a save of unchanged bytes would measure ckptflow's dedup, not a save."""
    for tensor in flat_tensors(state).values():
        tensor.add_(1)


def describe(shape: str, state: dict[str, Any]) -> str:
    tensors = flat_tensors(state).values()
    return f"{shape} ({len(tensors):,} tensors, {sum(t.nbytes for t in tensors) / MiB:.1f} MiB)"


def preallocated_like(tree: Any) -> Any:
    """The same structure with zeroed (so touched) tensors of the same shapes: DCP's load target."""
    if isinstance(tree, dict):
        return {key: preallocated_like(value) for key, value in tree.items()}
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else tree


def check_tensors(got: Any, expected: dict[str, torch.Tensor], method: str) -> None:
    """Fail unless ``got`` holds exactly the expected tensors under the same key paths, bit for bit."""
    tensors = flat_tensors(got)
    same = tensors.keys() == expected.keys() and all(
        t.dtype == expected[key].dtype and torch.equal(t, expected[key]) for key, t in tensors.items()
    )
    if not same:
        raise SystemExit(f"{method}: the tensors loaded differ from the state saved")


# -- the methods -------------------------------------------------------------------------------------


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def ckptflow_fresh_save(state: dict[str, Any], path: Path) -> None:
    CheckpointStore(path).save(state, epoch=1)


def torch_save(state: dict[str, Any], path: Path) -> None:
    torch.save(state, path)
    fsync_path(path)
    fsync_path(path.parent)


def safetensors_save(state: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    tensors = flat_tensors(state)
    metadata = {key: json.dumps(value) for key, value in leaves(state) if key not in tensors}
    save_file(tensors, str(path), metadata=metadata)
    fsync_path(path)
    fsync_path(path.parent)


def dcp_save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(path), thread_count=1, sync_files=True)
    dcp.save(state, storage_writer=writer, no_dist=True)
    fsync_path(path)


FIRST_SAVES: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "torch": torch_save,
    "ckptflow": ckptflow_fresh_save,
}


def timed_saves(
    save: Callable[[dict[str, Any], Path], None], state: dict[str, Any], work: Path, repeats: int
) -> tuple[float, Path]:
    """Median seconds of ``repeats`` saves, each to a new path, and the last path (kept for the loads)."""
    paths = [work / f"save-{i}" for i in range(repeats)]
    times = []
    for i, path in enumerate(paths):
        change(state)
        os.sync()
        times.append(seconds(save, state, path))
        if i:
            remove(paths[i - 1])
    return statistics.median(times), paths[-1]


def timed_loads(
    load: Callable[[], Any], expected: dict[str, torch.Tensor], repeats: int, method: str
) -> float:
    """Median seconds of ``repeats`` loads, after one untimed load whose tensors are checked."""
    check_tensors(load(), expected, method)
    return median_seconds(load, repeats)


def child_command(method: str, shape: str, path: Path, args: argparse.Namespace) -> list[str]:
    """This script in child mode: a fresh process that saves ``shape`` once with ``method`` to ``path``."""
    child = ["--child", method, "--child-path", str(path), "--shapes", shape]
    scales = ["--scale", str(args.scale), "--transformer-scale", str(args.transformer_scale)]
    return [sys.executable, str(Path(__file__).resolve()), *child, *scales]


def first_saves(shape: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    """Median seconds of the one save of a fresh process, per method, the methods taking turns."""
    times: dict[str, list[float]] = {method: [] for method in FIRST_SAVES}
    for sample in range(args.samples):
        for method in FIRST_SAVES:
            path = work / f"first-{method}-{sample}"
            cmd = child_command(method, shape, path, args)
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            times[method].append(float(out.split()[-1]))
            remove(path)
    return {f"first-{method}": statistics.median(samples) for method, samples in times.items()}


def ckptflow_times(state: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, float]:
    expected = flat_tensors(state)
    with CheckpointStore(work / "store") as store:
        store.save(state, epoch=0)  # untimed: later saves find what a process's first save builds
        times = []
        for epoch in range(1, args.repeats + 1):
            change(state)
            os.sync()
            times.append(seconds(functools.partial(store.save, state, epoch=epoch)))
            store.prune(keep_last=1)
        return {
            "save-ckptflow": statistics.median(times),
            "load-ckptflow": timed_loads(store.load, expected, args.repeats, "ckptflow load()"),
            "load-ckptflow-noverify": timed_loads(
                functools.partial(store.load, verify=False),
                expected,
                args.repeats,
                "ckptflow load(verify=False)",
            ),
        }


def torch_times(state: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, float]:
    save, path = timed_saves(torch_save, state, work, args.repeats)
    load = functools.partial(torch.load, path, weights_only=True)
    return {
        "save-torch": save,
        "load-torch": timed_loads(load, flat_tensors(state), args.repeats, "torch.load"),
    }


def safetensors_times(state: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, float]:
    from safetensors.torch import load_file

    save, path = timed_saves(safetensors_save, state, work, args.repeats)
    load = functools.partial(load_file, str(path))
    expected = flat_tensors(state)
    return {
        "save-safetensors": save,
        "load-safetensors": timed_loads(load, expected, args.repeats, "safetensors"),
    }


def dcp_times(state: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    save, path = timed_saves(dcp_save, state, work, args.repeats)
    target = preallocated_like(state)

    def load() -> Any:
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
        return target

    return {"save-dcp": save, "load-dcp": timed_loads(load, flat_tensors(state), args.repeats, "DCP load")}


IN_PROCESS = {
    "ckptflow": ckptflow_times,
    "torch": torch_times,
    "safetensors": safetensors_times,
    "DCP": dcp_times,
}

# -- the table ---------------------------------------------------------------------------------------

# (operation, timing key, method, anchor key)
ROWS = [
    ("first save (fresh process)", "first-ckptflow", "ckptflow `CheckpointStore(dir).save`", "first-torch"),
    ("first save (fresh process)", "first-torch", "`torch.save` + fsync", "first-torch"),
    ("save", "save-ckptflow", "ckptflow `save` (later saves, same store)", "save-torch"),
    ("save", "save-torch", "`torch.save` + fsync", "save-torch"),
    ("save", "save-safetensors", "safetensors `save_file` + fsync", "save-torch"),
    ("save", "save-dcp", "DCP `save` (1 thread, `sync_files=True`)", "save-torch"),
    ("load", "load-ckptflow", "ckptflow `load()` (checksums checked)", "load-torch"),
    ("load", "load-ckptflow-noverify", "ckptflow `load(verify=False)`", "load-torch"),
    ("load", "load-torch", "`torch.load(weights_only=True)`", "load-torch"),
    ("load", "load-safetensors", "safetensors `load_file`", "load-torch"),
    ("load", "load-dcp", "DCP `load` into a preallocated state", "load-torch"),
]


def table_rows(label: str, times: dict[str, float]) -> list[list[str]]:
    return [
        [label, operation, method, f"{times[key]:.4f}", f"{times[anchor] / times[key]:.2f}x"]
        for operation, key, method, anchor in ROWS
    ]


def report(rows: list[list[str]], args: argparse.Namespace, load_at_start: str, took: float) -> str:
    table = markdown_table(["shape", "operation", "method", "seconds", "vs torch"], "lllrr", rows)
    return (
        f"Seconds: median of {args.repeats} repeats in one process (loads after one untimed load: from "
        f"the page cache); the first-save rows: median of {args.samples} fresh processes, each timing its "
        "one save. vs torch = torch's seconds / the row's (above 1: faster than torch). Targets: ckptflow "
        "at least 1.2x, and at least 0.5x at 100,000 tensors. Scale "
        f"{args.scale:g}; transformer+AdamW at {args.scale * args.transformer_scale:g}x GPT-2 small's "
        f"widths.\n\n{table}\n\nMachine: {machine()}; load average {load_at_start} at the start, "
        f"{load_average()} at the end; the whole run {took:.0f} s."
    )


# -- the driver --------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure_shape(shape: str, args: argparse.Namespace, work: Path) -> list[list[str]]:
    state = build_state(shape, shape_scale(shape, args))
    label = describe(shape, state)
    log(f"{label}: first saves, {args.samples} fresh processes per method")
    times = first_saves(shape, args, work)
    for method, measure in IN_PROCESS.items():
        log(f"{label}: {method}")
        method_dir = work / method
        method_dir.mkdir()
        times |= measure(state, args, method_dir)
        shutil.rmtree(method_dir)
    return table_rows(label, times)


def compile_package() -> None:
    """Compile ckptflow's modules to bytecode, as ``pip install`` leaves an installed package."""
    import compileall

    for name in ("storage", "tasks", "flows"):
        module = __import__(f"ckptflow.{name}", fromlist=["_"])
        compileall.compile_dir(str(Path(module.__file__).resolve().parent), quiet=1)


def run_child(args: argparse.Namespace) -> None:
    """One fresh process: build the state, then time its one save and print the seconds."""
    shape = args.shapes[0]
    state = build_state(shape, shape_scale(shape, args))
    os.sync()
    print(seconds(FIRST_SAVES[args.child], state, Path(args.child_path)))


def shape_list(text: str) -> list[str]:
    shapes = text.split(",")
    unknown = [shape for shape in shapes if shape not in SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shapes {unknown}; choose from {','.join(SHAPES)}")
    return shapes


def positive(kind: Callable[[str], float]) -> Callable[[str], Any]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
        return value

    return parse


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", type=shape_list, default=SHAPES, help="comma list of: " + ",".join(SHAPES))
    p.add_argument("--repeats", type=positive(int), default=5, help="timed repeats in one process (median)")
    p.add_argument("--samples", type=positive(int), default=5, help="fresh processes per first save (median)")
    p.add_argument("--scale", type=positive(float), default=1.0, help="shrinks every shape (smoke tests)")
    p.add_argument(
        "--transformer-scale", type=positive(float), default=0.5, help="GPT-2 small's widths x this"
    )
    p.add_argument("--dir", type=Path, help="where to write (default: a temp directory on a real disk)")
    p.add_argument("--markdown-out", type=Path, help="also write the report to this file")
    p.add_argument("--child", choices=FIRST_SAVES, help=argparse.SUPPRESS)
    p.add_argument("--child-path", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        run_child(args)
        return
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP's no_dist=True
    compile_package()
    base = args.dir or disk_temp_dir()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckptflow-bench-many-", dir=base))
    load_at_start, start = load_average(), time.perf_counter()
    rows: list[list[str]] = []
    try:
        for i, shape in enumerate(args.shapes):
            shape_dir = work / f"shape-{i}"
            shape_dir.mkdir()
            rows += measure_shape(shape, args, shape_dir)
            shutil.rmtree(shape_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(report(rows, args, load_at_start, time.perf_counter() - start), args.markdown_out)


if __name__ == "__main__":
    main()
