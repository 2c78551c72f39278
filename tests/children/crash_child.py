"""A training-like process for the crash-safety tests: saves version after version until killed.

    python tests/children/crash_child.py URL SEED [--mib 160] [--mode sync|async] [--count N]
                                                [--kill-at POINT]

Version ``v`` holds ``make_state(SEED, v, mib)``: a model, an optimizer-like
nested structure and some odds and ends, about ``mib`` MiB of tensors, every
byte determined by (seed, version), so a test can recompute what each
committed version must contain. The child prints, flushed, one line per event:

    saving V            right before ``save`` / ``save_async`` of version V
    committed V SECS    once version V is known to be committed (SECS: its save's wall time)

In async mode the state is changed in place right after ``save_async``
returns (as training would), while the version is written in the background;
the next ``save_async`` waits for it. ``--kill-at POINT`` makes the child
SIGKILL itself at a precise point of the save of version 1 (see
``KILL_POINTS``). ``storage_options`` come as JSON in the environment variable
``CKPTFLOW_STORAGE_OPTIONS`` (credentials stay off the command line). The
child stops by itself when its parent dies, so a crashed test run cannot
leave it filling the disk.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

# Fraction of the state's bytes per big tensor: (key path, dtype, share).
_LAYOUT: list[tuple[str, torch.dtype, float]] = [
    ("model/embed.weight", torch.float32, 0.26),
    ("model/layers.0.weight", torch.float32, 0.18),
    ("model/layers.1.weight", torch.bfloat16, 0.10),
    ("optimizer/state/0/exp_avg", torch.float32, 0.13),
    ("optimizer/state/0/exp_avg_sq", torch.float32, 0.13),
    ("optimizer/state/1/exp_avg", torch.float32, 0.10),
    ("optimizer/state/1/exp_avg_sq", torch.float16, 0.10),
]
_COLUMNS = 1024
FROZEN = "model/embed.weight"

KILL_POINTS = (
    "mid-shard",  # after about half of the version's shard bytes were written
    "before-manifest",  # every shard written and fsynced, manifest not yet started
    "manifest-rename",  # manifest written to its temporary name, not yet renamed
    "before-latest",  # manifest in place (committed), ``latest`` not yet updated
    "latest-rename",  # ``latest`` written to its temporary name, not yet renamed
)


@functools.lru_cache(maxsize=2)
def _base(seed: int, mib: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    total = mib << 20
    out = []
    for _, dtype, share in _LAYOUT:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        rows = max(1, int(total * share) // (itemsize * _COLUMNS))
        out.append(torch.randn(rows, _COLUMNS, generator=gen, dtype=torch.float32).to(dtype))
    return tuple(out)


def make_state(seed: int, version: int, mib: int) -> dict[str, Any]:
    """The state the child saves as ``version``: deterministic in (seed, version, mib)."""
    # The embedding stays as it is (a frozen part, 26% of the bytes): later versions reference its
    # bytes in version 0's files instead of writing them again (content-addressed saves).
    big = {
        path: t if path == FROZEN else t + version
        for (path, _, _), t in zip(_LAYOUT, _base(seed, mib), strict=True)
    }
    gen = torch.Generator().manual_seed(seed * 7919 + version)
    return {
        "model": {
            "embed.weight": big["model/embed.weight"],
            "layers.0.weight": big["model/layers.0.weight"],
            "layers.1.weight": big["model/layers.1.weight"],
            "layers.1.bias": torch.randn(_COLUMNS, generator=gen),
            "head.index": torch.randint(0, 1 << 40, (4096,), generator=gen, dtype=torch.int64),
            "norm.scale": torch.randn(_COLUMNS, generator=gen).to(torch.bfloat16),
        },
        "optimizer": {
            "state": {
                0: {
                    "step": torch.tensor(float(version)),
                    "exp_avg": big["optimizer/state/0/exp_avg"],
                    "exp_avg_sq": big["optimizer/state/0/exp_avg_sq"],
                },
                1: {
                    "step": torch.tensor(float(version)),
                    "exp_avg": big["optimizer/state/1/exp_avg"],
                    "exp_avg_sq": big["optimizer/state/1/exp_avg_sq"],
                },
            },
            "param_groups": [
                {"lr": 1e-3 / (1 + version), "betas": (0.9, 0.999), "eps": 1e-8, "params": [0, 1]},
            ],
        },
        "epoch": version,
        "mask": torch.rand(777, generator=gen) > 0.5,
        "numpy_rng": np.random.default_rng(seed + version).integers(0, 255, 333, dtype=np.uint8),
        "note": f"seed={seed} version={version}",
    }


def copy_state_(dst: Any, src: Any) -> Any:
    """Copy ``src`` into ``dst`` in place where they hold tensors (as a training step would)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
        return dst
    if isinstance(dst, dict):
        for key in src:
            dst[key] = copy_state_(dst[key], src[key]) if key in dst else src[key]
        return dst
    return src


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached


def install_kill_point(point: str, state_bytes: int) -> None:
    """Patch the storage library so that this process SIGKILLs itself at ``point``."""
    from ckptflow.storage.files import byteio
    from ckptflow.storage.versions import commit

    if point == "mid-shard":
        written = [0]
        lock = threading.Lock()
        original_write = byteio.LocalSink.write

        def write(self: byteio.LocalSink, data: Any) -> None:
            original_write(self, data)
            with lock:
                written[0] += len(data)
                if written[0] >= state_bytes // 2:
                    _die()

        byteio.LocalSink.write = write  # type: ignore[method-assign]
    elif point == "before-manifest":
        commit.commit = lambda loc, manifest, **kwargs: _die()  # type: ignore[assignment]
    elif point in ("manifest-rename", "latest-rename"):
        target = "manifest.json" if point == "manifest-rename" else commit.LATEST_FILE
        original_replace = os.replace

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            if os.path.basename(os.fspath(dst)) == target:
                _die()
            original_replace(src, dst, **kwargs)

        commit.os.replace = replace  # type: ignore[attr-defined]
        original_link = os.link  # the manifest is hard-linked into place: it never replaces another's

        def link(src: Any, dst: Any, **kwargs: Any) -> None:
            if os.path.basename(os.fspath(dst)) == target:
                _die()
            original_link(src, dst, **kwargs)

        commit.os.link = link  # type: ignore[attr-defined]
    elif point == "before-latest":
        commit._write_latest = lambda loc, vdir: _die()  # type: ignore[assignment]
    else:
        raise SystemExit(f"unknown kill point {point!r}; known: {', '.join(KILL_POINTS)}")


def _nbytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("seed", type=int)
    parser.add_argument("--mib", type=int, default=160)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--count", type=int, default=0, help="versions to save; 0: until killed")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--kill-at", choices=KILL_POINTS)
    args = parser.parse_args(argv)

    from ckptflow.storage import CheckpointStore, StoreOptions

    options = json.loads(os.environ.get("CKPTFLOW_STORAGE_OPTIONS") or "null")
    store = CheckpointStore(
        args.url,
        storage_options=options,
        options=StoreOptions(shards=args.shards, threads=args.threads, shard_bytes=1),
    )
    parent = os.getppid()
    state = make_state(args.seed, 0, args.mib)
    pending = None  # async: (handle, start time) of the version in flight
    version = 0
    while args.count == 0 or version < args.count:
        if os.getppid() != parent:
            return 1  # the test that started us is gone
        if version == 1 and args.kill_at:
            install_kill_point(args.kill_at, _nbytes(state))
        print(f"saving {version}", flush=True)
        start = time.perf_counter()
        if args.mode == "sync":
            info = store.save(state, epoch=version)
            assert info.version == version, (info.version, version)
            print(f"committed {version} {time.perf_counter() - start:.4f}", flush=True)
            state = make_state(args.seed, version + 1, args.mib)
        else:
            handle = store.save_async(state, epoch=version)  # waits for the previous one first
            assert handle.version == version, (handle.version, version)
            if pending is not None:
                info = pending[0].wait()
                print(f"committed {info.version} {time.perf_counter() - pending[1]:.4f}", flush=True)
            pending = (handle, start)
            copy_state_(state, make_state(args.seed, version + 1, args.mib))
        version += 1
    if pending is not None:
        info = pending[0].wait()
        print(f"committed {info.version} {time.perf_counter() - pending[1]:.4f}", flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
