"""The GPU paths, on a machine with a CUDA GPU (tests/conftest.py collects this package only there).

Saves copy GPU tensors into pinned host memory with copies that run on while the save goes on
(``storage/save/staging.py``, sharded state included); loads copy host bytes into GPU
tensors. These tests check the values that land, bit for bit, with training changing the GPU
tensors the moment a save returns.
"""

from __future__ import annotations

import pytest
import torch

from tests.sharded.conftest import saved_by_store

if not torch.cuda.is_available():
    pytest.exit("tests/cuda needs a CUDA GPU: torch.cuda.is_available() is False here", returncode=4)

__all__ = ["saved_by_store"]
