"""A blob: the bytes of one dataset of a shard file, and how a writer reads them.

The planner (``save/planner.py``) cuts a state into blobs, the writer lays them out
in shard files (``format/h5layout.py``): both sides of the format know this type,
so it lives here, below them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Blob:
    """Bytes written as one dataset: ``numel`` elements of ``dtype``, laid out as ``shape``."""

    index: int
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: torch.Tensor  # the data, viewed so that ``source.contiguous()`` is exactly the bytes

    @functools.cached_property
    def nbytes(self) -> int:
        return self.source.numel() * self.source.element_size()


BlobBytes = Callable[[Blob], memoryview]  # a blob's bytes, as they go into its dataset

__all__ = ["Blob", "BlobBytes"]
