"""How long a ``save_async`` of a GPU-resident training state blocks training.

A model of ``--params`` float32 parameters (square bias-free linear layers of
``--width``) with the state of ``torch.optim.AdamW`` after one step, all on the
GPU (1.2B parameters: 14 GiB with the optimizer state). Times, each median of
``--repeats`` after one untimed call (the first call's time is shown apart):

- the floor: the state's device-to-host copy into pinned host memory allocated
  beforehand (``copy_(non_blocking=True)`` of every tensor, one synchronize);
- ckptflow ``save_async``: the time until it returns (training may change its
  tensors then), and until ``wait()`` returns (committed, fsync included);
- DCP ``async_save`` with pinned-memory staging (``DefaultStager``): the time
  until its staging is complete (training may change its tensors then), and
  until its upload completes.

Needs CUDA and disk room for two copies of the state under ``--dir``.

Run: ``.venv/bin/python bench/bench_gpu_stall.py [--params 1.2e9] [--repeats 3]``;
a smoke test without a GPU: ``--device cpu --params 2e6 --width 256``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file or with -m

from bench.common import disk_temp_dir, emit, machine, markdown_table


def build_state(params: float, width: int, device: str) -> dict[str, Any]:
    """A model of about ``params`` parameters and its AdamW state after one step, on ``device``."""
    import torch

    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(
        *(torch.nn.Linear(width, width, bias=False, device=device) for _ in range(layers))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def tensors_of(tree: Any) -> list[Any]:
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_of(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_of(v)]
    return []


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def copy_floor(state: dict[str, Any], device: str, repeats: int) -> list[float]:
    """Seconds of the state's copy into pinned host buffers allocated (and touched) beforehand."""
    import torch

    sources = tensors_of(state)
    pinned = device == "cuda"
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in sources]

    def copy() -> None:
        for buf, t in zip(buffers, sources, strict=True):
            buf.copy_(t, non_blocking=pinned)
        synchronize(device)

    return [timed(copy, device) for _ in range(repeats + 1)]


def ckptflow_saves(
    state: dict[str, Any], work: Path, device: str, repeats: int
) -> tuple[list[float], list[float]]:
    """(seconds until save_async returns, seconds until wait() returns), one per call."""
    from ckptflow.storage import CheckpointStore

    store = CheckpointStore(work / "ckptflow")
    blocked, total = [], []
    for i in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        handle = store.save_async(state, epoch=i)
        blocked.append(time.perf_counter() - start)
        handle.wait()
        total.append(time.perf_counter() - start)
        store.prune(keep_last=1)
    store.close()
    shutil.rmtree(work / "ckptflow")
    return blocked, total


def dcp_saves(
    state: dict[str, Any], work: Path, device: str, repeats: int
) -> tuple[list[float], list[float]]:
    """(seconds until DCP's staging is complete, seconds until its upload completes), one per call."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=device == "cuda",
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=device == "cuda",
    )
    stager = DefaultStager(options)
    blocked, total = [], []
    for i in range(repeats + 1):
        path = work / f"dcp-{i}"
        synchronize(device)
        start = time.perf_counter()
        response = dcp.async_save(state, checkpoint_id=str(path), async_stager=stager, no_dist=True)
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            staging.result()
        blocked.append(time.perf_counter() - start)
        upload = getattr(response, "upload_completion", response)
        upload.result()
        total.append(time.perf_counter() - start)
        shutil.rmtree(work / f"dcp-{i - 1}", ignore_errors=True)
    stager.close()
    shutil.rmtree(work, ignore_errors=True)
    return blocked, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=1.2e9)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--markdown-out", type=Path)
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu for a smoke test")
    state = build_state(args.params, args.width, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    work = Path(tempfile.mkdtemp(prefix="ckptflow-gpu-stall-", dir=args.dir or disk_temp_dir()))
    try:
        floor = copy_floor(state, args.device, args.repeats)
        ours_blocked, ours_total = ckptflow_saves(state, work, args.device, args.repeats)
        dcp_blocked, dcp_total = dcp_saves(state, work / "dcp", args.device, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    copy = statistics.median(floor[1:])
    rows = [
        ("device-to-host copy into pinned memory (the floor)", floor[0], copy),
        ("ckptflow `save_async`: training blocked", *_first_later(ours_blocked)),
        ("ckptflow: until `wait()` returns (committed)", *_first_later(ours_total)),
        ("DCP `async_save`, pinned staging: training blocked", *_first_later(dcp_blocked)),
        ("DCP: until the upload completes", *_first_later(dcp_total)),
    ]
    table = markdown_table(
        ["", "first call (s)", "later calls (s)", "later vs the copy"],
        "lrrr",
        [(name, f"{first:.3f}", f"{later:.3f}", f"{later / copy:.2f}x") for name, first, later in rows],
    )
    report = (
        f"A {args.params / 1e9:.3g}B-parameter float32 model + AdamW state on {args.device} "
        f"({nbytes / (1 << 30):.1f} GiB); later calls: median of {args.repeats}.\n\n{table}\n\n"
        f"Machine: {machine()}" + (f"; {torch.cuda.get_device_name()}" if args.device == "cuda" else "") + "."
    )
    emit(report, args.markdown_out)


def _first_later(samples: list[float]) -> tuple[float, float]:
    return samples[0], statistics.median(samples[1:])


if __name__ == "__main__":
    main()
