"""How each torch dtype is stored in HDF5.

HDF5 (and numpy) know no bfloat16, float8 or 16-bit complex. Such tensors are
stored as an unsigned integer of the same width holding the same bits, and the
manifest (and a dataset attribute) records the torch dtype, so the bytes come
back exactly. Every stored dtype is little-endian and fixed width: a shard is
a plain byte image of the tensors, readable without torch.
"""

from __future__ import annotations

import numpy as np
import torch

from .dtypenames import BIT_CAST_WIDTHS, NATIVE, UINT_OF_WIDTH

# The tables of .dtypenames, for the dtypes this torch has.
_NATIVE: dict[torch.dtype, np.dtype] = {
    getattr(torch, name): np.dtype(code) for name, code in NATIVE.items() if hasattr(torch, name)
}
_BIT_CAST: dict[torch.dtype, np.dtype] = {
    getattr(torch, name): np.dtype(UINT_OF_WIDTH[width])
    for name, width in BIT_CAST_WIDTHS.items()
    if hasattr(torch, name)
}

SUPPORTED: frozenset[torch.dtype] = frozenset(_NATIVE) | frozenset(_BIT_CAST)


def dtype_name(dtype: torch.dtype) -> str:
    """The name used in manifests, e.g. ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises ``ValueError`` for unknown names."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED:
        raise ValueError(f"unknown or unsupported tensor dtype {name!r}")
    return dtype


def storage_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a tensor of ``dtype`` is stored as in HDF5."""
    if dtype in _NATIVE:
        return _NATIVE[dtype]
    if dtype in _BIT_CAST:
        return _BIT_CAST[dtype]
    raise TypeError(f"tensors of dtype {dtype} cannot be stored")
