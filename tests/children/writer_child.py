"""A writer for the single-writer tests: saves COUNT versions into one store, racing another writer.

    python tests/children/writer_child.py URL TAG COUNT GO_FILE [--lease TIMEOUT] [--hold SECONDS]

It waits until ``GO_FILE`` exists (so that two writers start together), then
saves version after version of ``make_state(TAG, i)`` with automatic version
numbers and prints, flushed, one line per save: ``committed V I`` or
``failed I ERRORTYPE MESSAGE``. With ``--lease`` it first holds the store's
writer lease (printing ``leased`` or ``refused MESSAGE``) and keeps it for
``--hold`` seconds after its saves. ``storage_options`` come as JSON in
``CKPTFLOW_STORAGE_OPTIONS``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

ELEMENTS = 1 << 20  # 4 MiB of float32 per tensor, two tensors per state


def make_state(tag: int, i: int) -> dict[str, object]:
    base = float(tag * 1000 + i)
    return {
        "a": torch.full((ELEMENTS,), base),
        "b": torch.arange(ELEMENTS, dtype=torch.float32) + base,
        "who": {"tag": tag, "i": i},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("tag", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("go")
    parser.add_argument("--lease", type=float)
    parser.add_argument("--hold", type=float, default=0.0)
    args = parser.parse_args(argv)

    from ckptflow.storage import CheckpointError, CheckpointStore, StoreOptions

    options = json.loads(os.environ.get("CKPTFLOW_STORAGE_OPTIONS") or "null")
    store = CheckpointStore(
        args.url, storage_options=options, options=StoreOptions(shards=4, threads=2, shard_bytes=1)
    )
    print("ready", flush=True)
    while not os.path.exists(args.go):
        time.sleep(0.005)
    lease = contextlib.nullcontext()
    if args.lease is not None:
        from ckptflow.storage import StoreLockedError

        try:
            lease = store.lease(owner=f"writer {args.tag}", timeout=args.lease)
            lease.__enter__()
        except StoreLockedError as exc:
            print(f"refused {exc}", flush=True)
            return 3
        print("leased", flush=True)
    try:
        for i in range(args.count):
            try:
                info = store.save(make_state(args.tag, i), epoch=i, user={"tag": args.tag, "i": i})
            except CheckpointError as exc:
                print(f"failed {i} {type(exc).__name__} {exc}", flush=True)
                continue
            print(f"committed {info.version} {i}", flush=True)
        time.sleep(args.hold)
    finally:
        lease.__exit__(*sys.exc_info())
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
