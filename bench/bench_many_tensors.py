"""States of many small tensors: ckptflow's per-tensor costs against torch.save / torch.load.

A state of ``--tensors`` float32 tensors of ``--numel`` elements each (default
20,000 of 64: 5 MiB, the shape of a model with many small parameters, biases,
norms and their optimizer state), where the bytes are few and what a save or a
load does per tensor decides the time. Times, in one process, on a real disk:

- ckptflow ``save``: the first save of a run (it lays the shard out with h5py,
  once per layout) and a later one (the layout is cached);
- ckptflow ``load()`` (every blob checked against its checksum) and
  ``load(verify=False)``;
- ``torch.save`` (fsync'd) and ``torch.load(weights_only=True)``.

Run: ``.venv/bin/python bench/bench_many_tensors.py [--tensors 20000] [--numel 64] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file or with -m

from bench.common import disk_temp_dir, emit, fsync_path, machine, markdown_table, median_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=20_000)
    parser.add_argument("--numel", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown-out", type=Path)
    args = parser.parse_args()

    import torch

    from ckptflow.storage import CheckpointStore

    torch.manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(args.numel) for i in range(args.tensors)}
    work = Path(tempfile.mkdtemp(prefix="ckptflow-bench-many-", dir=disk_temp_dir()))
    try:
        store = CheckpointStore(work / "store")
        epochs = iter(range(1, 10_000))
        start = time.perf_counter()
        store.save(state, epoch=next(epochs))  # the first save of the process: the layout is built
        first = time.perf_counter() - start
        cached = median_seconds(lambda: store.save(state, epoch=next(epochs)), args.repeats)
        load = median_seconds(store.load, args.repeats)
        unverified = median_seconds(lambda: store.load(verify=False), args.repeats)
        pt = work / "state.pt"

        def torch_save() -> None:
            torch.save(state, pt)
            fsync_path(pt)

        tsave = median_seconds(torch_save, args.repeats)
        tload = median_seconds(lambda: torch.load(pt, weights_only=True), args.repeats)
        got = store.load()
        assert all(torch.equal(got[k], v) for k, v in state.items()), "a load differs from the state"
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = [
        ("save", "ckptflow, first save of the process (layout built)", first, tsave),
        ("save", "ckptflow, later saves (layout cached)", cached, tsave),
        ("save", "torch.save + fsync", tsave, tsave),
        ("load", "ckptflow load() (checksums checked)", load, tload),
        ("load", "ckptflow load(verify=False)", unverified, tload),
        ("load", "torch.load(weights_only=True)", tload, tload),
    ]
    table = markdown_table(
        ["", "method", "seconds", "vs torch"],
        "llrr",
        [(op, name, f"{s:.3f}", f"{anchor / s:.2f}x") for op, name, s, anchor in rows],
    )
    mib = args.tensors * args.numel * 4 / (1 << 20)
    report = (
        f"A state of {args.tensors} float32 tensors of {args.numel} elements ({mib:.1f} MiB); "
        f"median of {args.repeats} (the first save: one run).\n\n{table}\n\nMachine: {machine()}."
    )
    emit(report, args.markdown_out)


if __name__ == "__main__":
    main()
