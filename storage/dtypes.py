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

# torch dtypes numpy represents natively: stored as themselves.
_NATIVE: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype("|b1"),
    torch.uint8: np.dtype("|u1"),
    torch.int8: np.dtype("|i1"),
    torch.int16: np.dtype("<i2"),
    torch.int32: np.dtype("<i4"),
    torch.int64: np.dtype("<i8"),
    torch.float16: np.dtype("<f2"),
    torch.float32: np.dtype("<f4"),
    torch.float64: np.dtype("<f8"),
    torch.complex64: np.dtype("<c8"),
    torch.complex128: np.dtype("<c16"),
}
for _name, _np in (("uint16", "<u2"), ("uint32", "<u4"), ("uint64", "<u8")):
    if hasattr(torch, _name):
        _NATIVE[getattr(torch, _name)] = np.dtype(_np)

_UINT_OF_WIDTH: dict[int, np.dtype] = {
    1: np.dtype("|u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}

# Dtypes without a numpy twin, stored as same-width unsigned bits: name -> width in bytes.
_BIT_CAST_WIDTHS = {
    "bfloat16": 2,
    "complex32": 4,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}
_BIT_CAST: dict[torch.dtype, np.dtype] = {
    getattr(torch, name): _UINT_OF_WIDTH[width]
    for name, width in _BIT_CAST_WIDTHS.items()
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
