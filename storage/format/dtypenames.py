"""How each tensor dtype is stored, by the name manifests use: readable without torch.

:mod:`.dtypes` maps torch's dtypes through these tables; ``ckptflow show`` and
other readers of manifests use them as they are.
"""

from __future__ import annotations

# Dtypes numpy represents natively: stored as themselves (little-endian, fixed width).
NATIVE: dict[str, str] = {
    "bool": "|b1",
    "uint8": "|u1",
    "int8": "|i1",
    "int16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "float16": "<f2",
    "float32": "<f4",
    "float64": "<f8",
    "complex64": "<c8",
    "complex128": "<c16",
    "uint16": "<u2",  # in torch since 2.3
    "uint32": "<u4",
    "uint64": "<u8",
}

# Dtypes without a numpy twin, stored as same-width unsigned bits: name -> width in bytes.
BIT_CAST_WIDTHS: dict[str, int] = {
    "bfloat16": 2,
    "complex32": 4,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}

UINT_OF_WIDTH: dict[int, str] = {1: "|u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def itemsize(name: str) -> int | None:
    """Bytes per element of the dtype a manifest names (None if ckptflow does not store it)."""
    if name in NATIVE:
        return int(NATIVE[name][2:])  # "<f4" -> 4, "<c16" -> 16
    return BIT_CAST_WIDTHS.get(name)
