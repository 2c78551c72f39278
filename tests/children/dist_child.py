"""One rank of a torch.distributed job for the multi-process storage tests.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python tests/children/dist_child.py SCENARIO URL OUTDIR [--seed S] [--timeout SECS] ...

Every rank joins a gloo job on 127.0.0.1, runs the steps of ``SCENARIO`` (see
``SCENARIOS``) against a distributed :class:`CheckpointStore` at ``URL``, and
writes what happened to ``OUTDIR/result-r{rank}.json``: per step either
``{"ok": ...}`` or ``{"error": type name, "message": ..., "seconds": ...}``.
Loaded states are reported as digests (key path, dtype, shape and SHA-256 of
the raw bytes of every tensor), which the test compares with the digest of
the state it recomputes from the seed: ``make_state(seed, version)`` and
``make_rank_state(seed, version, rank)`` fix every byte.

``storage_options`` come as JSON in ``CKPTFLOW_STORAGE_OPTIONS``. A rank that
must be killed blocks, after writing part of its share, until its parent (the
test) SIGKILLs it; it announces that by creating ``OUTDIR/blocked-r{rank}``.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

LAYERS = 12  # replicated tensors of about the same size, so that the ranks' shares are even
WIDTH = 48


def make_state(seed: int, version: int) -> dict[str, Any]:
    """The replicated state (identical on every rank) saved as ``version``; bf16, a tied weight, a view."""
    gen = torch.Generator().manual_seed(seed * 1009 + version)
    model: dict[str, Any] = {"embed.weight": torch.randn(WIDTH, WIDTH, generator=gen)}
    for i in range(LAYERS):
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        cols = WIDTH * 2 if dtype == torch.bfloat16 else WIDTH  # same bytes as a float32 layer
        model[f"layers.{i}.weight"] = torch.randn(WIDTH, cols, generator=gen).to(dtype)
        model[f"layers.{i}.bias"] = torch.randn(WIDTH, generator=gen)
    model["head.weight"] = model["embed.weight"]  # tied: the same tensor under two keys
    # A frozen part, the same in every version: later versions reference its bytes in version 0.
    frozen = torch.Generator().manual_seed(seed)
    for i in range(2 * LAYERS):  # many tensors of a layer's size: the ranks' shares stay even
        model[f"frozen.{i}"] = torch.randn(WIDTH, WIDTH, generator=frozen)
    packed = torch.randn(2 * WIDTH, WIDTH, generator=gen)
    model["qkv.q"], model["qkv.k"] = packed[:WIDTH], packed[WIDTH:]  # two views of one storage
    optimizer = {
        "state": {
            i: {
                "step": torch.tensor(float(version + 1)),
                "exp_avg": torch.randn(WIDTH, WIDTH, generator=gen),
                "exp_avg_sq": torch.rand(WIDTH, WIDTH, generator=gen),
            }
            for i in range(LAYERS)
        },
        "param_groups": [{"lr": 1e-3 / (1 + version), "betas": (0.9, 0.999), "params": list(range(LAYERS))}],
    }
    return {"model": model, "optimizer": optimizer, "epoch": version, "note": f"seed={seed} v={version}"}


def make_rank_state(seed: int, version: int, rank: int) -> dict[str, Any]:
    """What rank ``rank`` keeps for itself (RNG state, data position): different on every rank."""
    gen = torch.Generator().manual_seed(seed * 31 + version * 7 + rank)
    return {
        "rank": rank,
        "torch_rng": gen.get_state(),
        "cursor": 1000 * rank + version,
        "perm": torch.randperm(40 + rank, generator=gen),
        "numpy": np.random.default_rng(seed + rank).integers(0, 1 << 30, 17 + rank, dtype=np.int64),
    }


def digest(state: Any, path: str = "") -> list[list[Any]]:
    """Every leaf of ``state`` in order: tensors and arrays as (dtype, shape, SHA-256 of the raw bytes)."""
    if isinstance(state, torch.Tensor):
        raw = state.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return [[path, "tensor", str(state.dtype), list(state.shape), hashlib.sha256(raw).hexdigest()]]
    if isinstance(state, np.ndarray):
        raw = np.ascontiguousarray(state).tobytes()
        return [[path, "ndarray", str(state.dtype), list(state.shape), hashlib.sha256(raw).hexdigest()]]
    if isinstance(state, dict):
        return [x for k, v in state.items() for x in digest(v, f"{path}/{k!r}")]
    if isinstance(state, (list, tuple)):
        return [[path, type(state).__name__, len(state)]] + [
            x for i, v in enumerate(state) for x in digest(v, f"{path}/{i}")
        ]
    return [[path, type(state).__name__, repr(state)]]


def sharing(state: dict[str, Any]) -> dict[str, bool]:
    """Whether the loaded state kept the tied weight one tensor and the views one storage."""
    model = state["model"]
    return {
        "tied": model["head.weight"] is model["embed.weight"],
        "views": model["qkv.q"].untyped_storage().data_ptr() == model["qkv.k"].untyped_storage().data_ptr(),
    }


def loaded(store: Any, version: int) -> dict[str, Any]:
    state = store.load(version)
    return {"digest": digest(state), "sharing": sharing(state)}


def loaded_rank_state(store: Any, version: int) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = store.load_rank_state(version)
    return {
        "digest": digest(state),
        "warnings": [f"{type(w.message).__name__}: {w.message}" for w in caught],
    }


def info_dict(info: Any) -> dict[str, Any]:
    return {"version": info.version, "epoch": info.epoch, "nbytes": info.nbytes, "size": info.size}


class Steps:
    """Runs named steps; records each one's outcome without stopping the scenario."""

    def __init__(self, out: Path, rank: int) -> None:
        self.out = out
        self.rank = rank
        self.results: dict[str, Any] = {}

    def run(self, name: str, fn: Any) -> Any:
        start = time.monotonic()
        try:
            value = fn()
        except Exception as exc:
            self.results[name] = {
                "error": type(exc).__name__,
                "message": str(exc),
                "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
                "seconds": round(time.monotonic() - start, 3),
                "traceback": traceback.format_exc(),
            }
            self.flush()
            return None
        self.results[name] = {"ok": value, "seconds": round(time.monotonic() - start, 3)}
        self.flush()
        return value

    def flush(self) -> None:
        tmp = self.out / f".result-r{self.rank}.json.tmp"
        tmp.write_text(json.dumps(self.results))
        os.replace(tmp, self.out / f"result-r{self.rank}.json")


# -- injected faults ------------------------------------------------------------------------------


def block_after_first_shard(out: Path, rank: int, version: int) -> None:
    """Patch the writer: after this rank's first shard of ``version``, wait to be SIGKILLed."""
    from ckptflow.storage.save import writer

    original = writer._write_shard
    parent = os.getppid()

    def write_shard(loc, version_dir, shard, *rest):  # type: ignore[no-untyped-def]
        result = original(loc, version_dir, shard, *rest)
        if version_dir == f"v{version:06d}" and shard.file.startswith("shard-"):
            (out / f"blocked-r{rank}").touch()
            while os.getppid() == parent:  # the test kills us here; if it died instead, leave
                time.sleep(0.05)
            os._exit(3)
        return result

    writer._write_shard = write_shard  # type: ignore[assignment]


def fail_writes(version: int) -> Any:
    """Patch the writer so that this rank's write of ``version`` fails with an I/O error; returns undo."""
    from ckptflow.storage.save import writer

    original = writer._write_shard

    def write_shard(loc, version_dir, *rest):  # type: ignore[no-untyped-def]
        if version_dir == f"v{version:06d}":
            raise OSError(errno.EIO, "injected I/O error on this rank")
        return original(loc, version_dir, *rest)

    writer._write_shard = write_shard  # type: ignore[assignment]
    return lambda: setattr(writer, "_write_shard", original)


def slow_writes(seconds: float) -> Any:
    """Patch the writer to pause before each shard (so that an async save surely overlaps training)."""
    from ckptflow.storage.save import writer

    original = writer._write_shard

    def write_shard(*args: Any) -> Any:
        time.sleep(seconds)
        return original(*args)

    writer._write_shard = write_shard  # type: ignore[assignment]
    return lambda: setattr(writer, "_write_shard", original)


# -- scenarios ------------------------------------------------------------------------------------


def committed_here(url: str, options: Any) -> dict[str, Any]:
    """What a separate, non-distributed store sees: committed versions and version directories."""
    from ckptflow.storage import CheckpointStore
    from ckptflow.storage.versions.commit import list_dirs

    plain = CheckpointStore(url, storage_options=options)
    return {"versions": [v.version for v in plain.versions()], "dirs": sorted(list_dirs(plain.loc))}


def train_while_saving(store: Any, state: dict[str, Any], seed: int, rank: int, world: int) -> dict:
    """save_async, then run the training loop's own all_reduce on the default group until it is committed."""
    import torch.distributed as dist

    undo = slow_writes(0.15)
    try:
        handle = store.save_async(state, epoch=1, rank_state=make_rank_state(seed, 1, rank))
        fresh = make_state(seed, 2)  # training goes on: the tensors change in place after save_async returns
        for key, t in state["model"].items():
            t.copy_(fresh["model"][key])
        steps, in_flight, wrong = 0, 0, 0
        while True:
            grad = torch.full((4096,), float(rank + steps))
            dist.all_reduce(grad)  # default group, main thread, while the save writes and commits
            want = float(sum(range(world)) + world * steps)
            wrong += int(not torch.all(grad == want))
            busy = torch.tensor([0 if handle.done() else 1])
            dist.all_reduce(busy, op=dist.ReduceOp.MAX)  # every rank stops at the same step
            in_flight += int(busy.item())
            steps += 1
            if not busy.item():
                break
        info = handle.wait(timeout=60)
    finally:
        undo()
    return {"info": info_dict(info), "steps": steps, "in_flight": in_flight, "wrong": wrong}


@dataclass
class Rank:
    """This rank's place in the job, its store, and the recorded steps of its scenario."""

    args: argparse.Namespace
    steps: Steps
    store: Any
    rank: int
    world: int

    def save(
        self, step: str, version: int, *, explicit: bool = False, own: Any = True, state: Any = None
    ) -> None:
        """Record ``store.save`` of ``make_state(seed, version)`` (or ``state``) with this rank's own state.

        ``own``: True for ``make_rank_state(seed, version, rank)``, None for no rank_state, or the value.
        """
        seed = self.args.seed
        rank_state = make_rank_state(seed, version, self.rank) if own is True else own
        self.steps.run(
            step,
            lambda: info_dict(
                self.store.save(
                    make_state(seed, version) if state is None else state,
                    epoch=version,
                    version=version if explicit else None,
                    rank_state=rank_state,
                )
            ),
        )

    def report_store(self, step: str) -> None:
        """Rank 0 records what a separate, non-distributed store sees."""
        if self.rank == 0:
            self.steps.run(step, lambda: committed_here(self.args.url, self.args.storage_options))


def scenario_roundtrip(r: Rank) -> None:
    """Save v0 (sync) and v1 (async, beside training collectives), then load both at this world size."""
    r.save("save0", 0)
    r.steps.run(
        "save1_async",
        lambda: train_while_saving(r.store, make_state(r.args.seed, 1), r.args.seed, r.rank, r.world),
    )
    for v in (0, 1):
        r.steps.run(f"load{v}", lambda v=v: loaded(r.store, v))
        r.steps.run(f"rank_state{v}", lambda v=v: loaded_rank_state(r.store, v))


def scenario_load(r: Rank) -> None:
    """Load v0, which another world size saved, then save ``--version`` and load it at this one."""
    r.steps.run("load0", lambda: loaded(r.store, 0))
    r.steps.run("rank_state0", lambda: loaded_rank_state(r.store, 0))
    r.save("save", r.args.version, explicit=True)
    r.steps.run("rank_state", lambda: loaded_rank_state(r.store, r.args.version))


def scenario_crash(r: Rank) -> None:
    """Commit v0; then rank ``--victim`` stops halfway through its share of v1 and is SIGKILLed."""
    r.save("save0", 0)
    if r.rank == r.args.victim:
        block_after_first_shard(Path(r.args.out), r.rank, 1)
    r.save("save1", 1)


def scenario_save(r: Rank) -> None:
    """Save ``--version`` from every rank."""
    r.save("save", r.args.version, explicit=True)


def scenario_failing(r: Rank) -> None:
    """Commit v0; rank ``--victim``'s write of v1 fails; then the same job saves v1 again."""
    r.save("save0", 0, own=None)
    undo = fail_writes(1) if r.rank == r.args.victim else (lambda: None)
    r.save("save1", 1, own=None)
    undo()
    r.report_store("after_failure")
    r.save("retry1", 1, explicit=True, own=None)


def scenario_full_disk(r: Rank) -> None:
    """Save ``--version`` on a disk the test filled, then the same with save_async; after each, rank 0
    records the store's files and the disk's free bytes (once its save has raised: all ranks reported)."""
    from tests.disks import files_under, free_bytes

    root = Path(r.args.url)
    version, seed = r.args.version, r.args.seed
    r.save("save", version, explicit=True)
    if r.rank == 0:
        r.steps.run("after_save", lambda: [files_under(root), free_bytes(root)])
    own = make_rank_state(seed, version, r.rank)

    def save_async() -> dict[str, Any]:
        handle = r.store.save_async(make_state(seed, version), version=version, rank_state=own)
        return info_dict(handle.wait())

    r.steps.run("save_async", save_async)
    if r.rank == 0:
        r.steps.run("after_save_async", lambda: [files_under(root), free_bytes(root)])


def scenario_mismatch(r: Rank) -> None:
    """Commit v0; rank 1 passes a replicated state of another shape; then a matching save works."""
    r.save("save0", 0, own=None)
    state = make_state(r.args.seed, 1)
    if r.rank == 1:
        state["model"]["layers.3.bias"] = torch.zeros(WIDTH + 1)
    r.save("save1", 1, own=None, state=state)
    r.report_store("after_failure")
    r.save("retry1", 1, own=None)


def scenario_bad_rank_state(r: Rank) -> None:
    """Rank 1's own state holds a value that cannot be stored: every rank must raise, none may hang."""
    own: dict[str, Any] = make_rank_state(r.args.seed, 0, r.rank)
    if r.rank == 1:
        own["sampler"] = threading.Lock()
    r.save("save0", 0, own=own)
    r.report_store("after_failure")
    r.save("retry0", 0)


SCENARIOS = {
    "roundtrip": scenario_roundtrip,
    "load": scenario_load,
    "crash": scenario_crash,
    "save": scenario_save,
    "failing": scenario_failing,
    "full_disk": scenario_full_disk,
    "mismatch": scenario_mismatch,
    "bad_rank_state": scenario_bad_rank_state,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--version", type=int, default=0)
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="the checkpoint group's timeout")
    parser.add_argument("--shards", type=int, default=2, help="shard files per version, in all")
    a = parser.parse_args(argv)
    a.storage_options = json.loads(os.environ.get("CKPTFLOW_STORAGE_OPTIONS") or "null")
    torch.set_num_threads(1)

    import torch.distributed as dist

    from ckptflow.storage import CheckpointStore, RankGroup, StoreOptions

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = Steps(Path(a.out), rank)
    group = RankGroup.create(timeout=timedelta(seconds=a.timeout))
    store = CheckpointStore(
        a.url,
        storage_options=a.storage_options,
        options=StoreOptions(shards=a.shards, threads=1, shard_bytes=1),
        distributed=group,
    )
    SCENARIOS[a.scenario](Rank(a, steps, store, rank, world))
    store.close()
    steps.results["done"] = True
    steps.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    # A job whose peer died cannot tear its groups down cleanly: leave without trying.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
