"""Reading onto a GPU: bytes land in pinned host memory, a batch at a time, and go on to the GPU
while the next batch is read.

A copy to the GPU from pageable memory waits for itself, and the memory a load reads into is
fresh (each page faulted in). From pinned memory a copy is only issued: the reads of the next
batch overlap it. torch's pinned-memory cache hands a block out again only once the copies
issued from it have ended, so a batch's block may be dropped as soon as its copies are issued,
and a load holds a few blocks of ``BATCH_BYTES``, never a host copy of the whole state (the cache
keeps them pinned for the process's later loads). A load waits for its last copies before it
returns (:func:`copies_ended`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch

BATCH_BYTES = 64 << 20  # blobs read into one pinned block; a larger blob goes through a buffer of its own
ALIGN = 64


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to ALIGN: the room a blob takes in a block."""
    return -(-nbytes // ALIGN) * ALIGN


def landing(nbytes: dict[int, int]) -> dict[int, torch.Tensor]:
    """Key -> a region of one new pinned host block, of that many bytes (regions 64-byte aligned, so
    that each can be viewed as any dtype)."""
    if not nbytes:
        return {}
    starts = list(itertools.accumulate((padded(n) for n in nbytes.values()), initial=0))
    block = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=True)
    return {key: block[start : start + n] for (key, n), start in zip(nbytes.items(), starts, strict=False)}


def batches(nbytes: dict[int, int], limit: int = BATCH_BYTES) -> list[list[int]]:
    """Keys in order, grouped so that each group takes at most ``limit`` bytes of a block (a larger
    one alone). torch's pinned-memory cache rounds a block up to a power of two: a group of
    BATCH_BYTES fills one block exactly."""
    groups: list[list[int]] = []
    size = 0
    for key, n in nbytes.items():
        if not groups or size + padded(n) > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += padded(n)
    return groups


def read_onto(
    device: torch.device,
    nbytes: dict[int, int],
    read: Callable[[list[int], dict[int, torch.Tensor]], dict[int, torch.Tensor]],
    into: dict[int, torch.Tensor],
) -> dict[int, torch.Tensor]:
    """Blob -> a uint8 tensor on a GPU with its bytes: ``into``'s (a GPU tensor's memory), else a
    new one on ``device``. ``read(blobs, buffers)`` reads blobs into host memory (into
    ``buffers`` where given), as ``read_blobs`` does."""
    out = {b: into.get(b) for b in nbytes}
    for group in batches(nbytes):
        small = {b: nbytes[b] for b in group if nbytes[b] <= BATCH_BYTES}
        host = read(group, landing(small))
        for blob in group:
            dest = out[blob]
            if dest is None:
                dest = out[blob] = torch.empty(nbytes[blob], dtype=torch.uint8, device=device)
            dest.copy_(host[blob], non_blocking=blob in small)
    copies_ended({t.device for t in out.values() if t is not None and t.is_cuda})
    return {b: t for b, t in out.items() if t is not None}


def copies_ended(devices: Iterable[torch.device] = ()) -> None:
    """Wait for the copies issued so far to ``devices`` (none given: the current GPU)."""
    for device in list(devices) or [torch.device("cuda", torch.cuda.current_device())]:
        torch.cuda.synchronize(device)


__all__ = ["BATCH_BYTES", "batches", "copies_ended", "landing", "padded", "read_onto"]
