"""Host staging buffers: a copy of the state that training may not touch.

An async save must copy the state before it returns, because the training
loop goes on to change its tensors. Tensors on an accelerator must reach host
memory before they can be written. Both go through one reusable buffer,
allocated once and kept between saves (allocating fresh memory costs about
three times as much as copying into memory already touched), and pinned where
CUDA is present so device copies run asynchronously; the copies of all blobs
are issued first and synchronised once, so the device-to-host transfers
overlap one another.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from .planner import Blob

ALIGN = 64


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class StagingBuffer:
    """One growable, reusable host buffer; ``stage`` copies blobs into it."""

    def __init__(self, *, pin: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._buffer.numel()

    def stage(self, blobs: list[Blob]) -> dict[int, memoryview]:
        """Copy every blob's bytes into the buffer; return a read-only view per blob.

        The views stay valid until the next call; the caller must not stage
        again while a previous staging is still being written.
        """
        with self._lock:
            total = sum(_aligned(b.nbytes) for b in blobs)
            if total > self._buffer.numel():
                self._buffer = torch.empty(0, dtype=torch.uint8)  # drop the old one first
                self._buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin)
            views: dict[int, memoryview] = {}
            offset = 0
            device_copy = False
            for blob in blobs:
                n = blob.nbytes
                region = self._buffer[offset : offset + n]
                if n:
                    device_copy |= _copy(blob.source, region, non_blocking=self._pin)
                views[blob.index] = region.numpy().data.toreadonly() if n else memoryview(b"")
                offset += _aligned(n)
            if device_copy and torch.cuda.is_available():
                torch.cuda.synchronize()
            return views

    def release(self) -> None:
        with self._lock:
            self._buffer = torch.empty(0, dtype=torch.uint8)


def _copy(src: torch.Tensor, region: torch.Tensor, *, non_blocking: bool) -> bool:
    """Copy ``src``'s elements into the uint8 ``region``; True if it came from a device.

    A contiguous CPU tensor is copied with one plain memmove: single-threaded and
    steady at memory speed, where torch's parallel copy_ slowed to a fifth when
    the other cores were busy (measured: 1 GiB in 0.065 s against 0.19-0.31 s).
    """
    if src.device.type == "cpu" and src.is_contiguous():
        ctypes.memmove(region.data_ptr(), src.data_ptr(), region.numel())  # releases the GIL
        return False
    region.view(src.dtype).view(src.shape).copy_(src, non_blocking=non_blocking)
    return src.device.type != "cpu"
