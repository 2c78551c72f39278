"""Host staging buffers: a copy of the state that training may not touch.

An async save must copy the state before it returns, because the training
loop goes on to change its tensors. Tensors on an accelerator must reach host
memory before they can be written. Both go through one reusable buffer,
allocated once and kept between saves (allocating fresh memory costs about
three times as much as copying into memory already touched), and pinned where
CUDA is present so device copies run asynchronously; the copies of all blobs
are issued first, so the device-to-host transfers overlap one another: an
async save synchronises once, a save that writes at once waits for each blob's
own copy (a CUDA event) just before writing it, so writes overlap the copies.

Every save path stages through it: a save's blobs (:meth:`StagingBuffer.stage`),
and a sharded state that DCP plans (:func:`stage_state`: this rank's shards of
its DTensors, rebuilt as DTensors over the buffer). A store holds one buffer
and releases it when it is closed.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..files.byteio import tensor_bytes
from ..format.blob import Blob

ALIGN = 64
PIECE = 16 << 20  # host copies are cut into pieces of this size, copied by a few threads at once
PARALLEL_FROM = 64 << 20  # below this much, one thread copies everything
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class StagingBuffer:
    """One growable, reusable host buffer; ``stage`` copies blobs into it."""

    def __init__(self, *, pin: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: list[Any] = []  # the events of the last staging's device copies

    @property
    def capacity(self) -> int:
        return self._buffer.numel()

    def stage(self, blobs: list[Blob]) -> dict[int, memoryview]:
        """Copy every blob's bytes into the buffer; return a read-only view per blob.

        The views stay valid until the next call; the caller must not stage
        again while a previous staging is still being written.
        """
        regions, events = self._issue(blobs)
        if events:
            torch.cuda.synchronize()
        return {i: _readonly(r) for i, r in regions.items()}

    def stage_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` in the buffer (contiguous, of the same dtype and shape), for a
        save that hands tensors on (a DCP save of sharded state); valid as :meth:`stage`'s views."""
        blobs = [Blob(i, "", t.dtype, tuple(t.shape), t.detach()) for i, t in enumerate(tensors)]
        regions, events = self._issue(blobs)
        if events:
            torch.cuda.synchronize()
        return [
            regions[b.index].view(b.dtype).view(b.shape) if b.nbytes else torch.empty(b.shape, dtype=b.dtype)
            for b in blobs
        ]

    def stage_overlapped(self, blobs: list[Blob]) -> Callable[[Blob], memoryview]:
        """For a save that writes while it stages: every copy is issued at once, and the function
        returned gives a blob's bytes as soon as its own copy has ended, so the first blobs are
        written while later ones are still on their way from the device (host blobs are copied
        before this returns). Valid until the next staging, as :meth:`stage`'s views."""
        regions, events = self._issue(blobs)
        views = {i: _readonly(r) for i, r in regions.items()}

        def bytes_of(blob: Blob) -> memoryview:
            event = events.get(blob.index)
            if event is not None:
                event.synchronize()
            return views[blob.index]

        return bytes_of

    def _issue(self, blobs: list[Blob]) -> tuple[dict[int, torch.Tensor], dict[int, Any]]:
        """Copy the host blobs and issue the device blobs' copies (asynchronous into pinned
        memory); return each blob's region of the buffer and, per device blob, an event its
        copy's end records."""
        with self._lock:
            for event in self._in_flight:  # copies of a staging whose save failed before waiting
                event.synchronize()
            total = sum(_aligned(b.nbytes) for b in blobs)
            if total > self._buffer.numel():
                self._buffer = torch.empty(0, dtype=torch.uint8)  # drop the old one first
                self._buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin)
            regions: dict[int, torch.Tensor] = {}
            events: dict[int, Any] = {}
            offset = 0
            moves: list[tuple[int, int, int]] = []  # (to, from, bytes) of contiguous host tensors
            for blob in blobs:
                n = blob.nbytes
                region = self._buffer[offset : offset + n]
                src = blob.source
                if n and src.device.type == "cpu" and src.is_contiguous():
                    moves.append((region.data_ptr(), src.data_ptr(), n))
                elif n:
                    _copy(src, region, non_blocking=self._pin)
                    if src.device.type == "cuda":
                        events[blob.index] = torch.cuda.Event()
                        events[blob.index].record(torch.cuda.current_stream(src.device))
                regions[blob.index] = region
                offset += _aligned(n)
            self._move(moves)
            self._in_flight = list(events.values())
            return regions, events

    def _move(self, moves: list[tuple[int, int, int]]) -> None:
        """memmove every host range; large totals in pieces, on a few threads (memmove releases the GIL)."""
        if COPY_THREADS == 1 or sum(n for _, _, n in moves) < PARALLEL_FROM:
            for dst, src, n in moves:
                ctypes.memmove(dst, src, n)
            return
        pieces = [
            (dst + start, src + start, min(PIECE, n - start))
            for dst, src, n in moves
            for start in range(0, n, PIECE)
        ]
        lanes = [pieces[i::COPY_THREADS] for i in range(COPY_THREADS)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="ckptflow-stage")
        for done in [self._pool.submit(_move_all, lane) for lane in lanes]:
            done.result()

    def release(self) -> None:
        with self._lock:
            for event in self._in_flight:
                event.synchronize()
            self._in_flight = []
            self._buffer = torch.empty(0, dtype=torch.uint8)
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def stage_state(buffer: StagingBuffer, state: object) -> object:
    """A copy of ``state`` in ``buffer`` that no training step changes, for a save that hands a
    state on (an async DCP save): this rank's shards of its DTensors (as DTensors of the same
    mesh and placements, over the buffer), its tensors, its other values copied; DCP
    ``Stateful`` objects as their ``state_dict()``. Valid until the buffer stages again."""
    import copy

    from .kinds import is_stateful

    dtensor = _dtensor_type()

    def plain(node: object) -> object:  # Stateful objects as their state (state_dict() called once)
        if isinstance(node, dict):
            return {k: plain(v) for k, v in node.items()}
        if type(node) in (list, tuple):
            assert isinstance(node, (list, tuple))
            return type(node)(plain(v) for v in node)
        if not isinstance(node, torch.Tensor) and is_stateful(node):
            return plain(node.state_dict())  # type: ignore[attr-defined]
        return node

    def tensors(node: object) -> list[torch.Tensor]:
        if dtensor is not None and isinstance(node, dtensor):
            return [node.to_local()]
        if isinstance(node, torch.Tensor):
            return [node]
        if isinstance(node, dict):
            return [t for v in node.values() for t in tensors(v)]
        if type(node) in (list, tuple):
            return [t for v in node for t in tensors(v)]  # type: ignore[attr-defined]
        return []

    def rebuilt(node: object, copies: Iterator[torch.Tensor]) -> object:
        if dtensor is not None and isinstance(node, dtensor):
            return dtensor.from_local(
                next(copies),
                node.device_mesh,
                node.placements,
                run_check=False,
                shape=node.shape,
                stride=node.stride(),
            )
        if isinstance(node, torch.Tensor):
            return next(copies)
        if isinstance(node, dict):
            return {k: rebuilt(v, copies) for k, v in node.items()}
        if type(node) in (list, tuple):
            return type(node)(rebuilt(v, copies) for v in node)  # type: ignore[call-arg,attr-defined]
        return copy.deepcopy(node)

    state = plain(state)
    return rebuilt(state, iter(buffer.stage_tensors(tensors(state))))


def _dtensor_type() -> Any:
    """DTensor, if this process has imported it (none to stage otherwise)."""
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None else None


def _readonly(region: torch.Tensor) -> memoryview:
    return region.numpy().data.toreadonly() if region.numel() else memoryview(b"")


def _move_all(pieces: list[tuple[int, int, int]]) -> None:
    for dst, src, n in pieces:
        ctypes.memmove(dst, src, n)


def _copy(src: torch.Tensor, region: torch.Tensor, *, non_blocking: bool) -> None:
    """Copy a device or non-contiguous tensor's elements into the uint8 ``region``.

    Contiguous host tensors go through :meth:`StagingBuffer._move` instead: plain memmoves on
    our own few threads stay steady at memory speed, where torch's parallel ``copy_`` slowed to
    a fifth when the other cores were busy (1 GiB in 0.065 s against 0.19-0.31 s).
    """
    region.view(src.dtype).view(src.shape).copy_(src, non_blocking=non_blocking)


def written_bytes(blobs: list[Blob], staging: Callable[[], StagingBuffer]) -> Callable[[Blob], memoryview]:
    """Where a save that writes at once takes each blob's bytes: host blobs as they are (no copy),
    blobs on a device through the pinned buffer ``staging()`` gives (made only if one is there),
    every copy issued now and each blob written once its own copy ends."""
    device = [b for b in blobs if b.source.device.type != "cpu"]
    if not device:
        return lambda b: tensor_bytes(b.source)
    staged = staging().stage_overlapped(device)
    on_device = {b.index for b in device}
    return lambda b: staged(b) if b.index in on_device else tensor_bytes(b.source)
