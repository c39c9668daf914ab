"""The dtypes eRDMA moves and reduces, with their one-byte wire codes.

bfloat16 has no numpy dtype of its own; it travels as ``uint16`` bits and is reduced through float32
with round-to-nearest-even, exactly as torch rounds.
"""

from __future__ import annotations

import numpy as np

# name -> (wire code, numpy storage dtype)
_TABLE: dict[str, tuple[int, np.dtype]] = {
    "float16": (1, np.dtype(np.float16)),
    "bfloat16": (2, np.dtype(np.uint16)),
    "float32": (3, np.dtype(np.float32)),
    "float64": (4, np.dtype(np.float64)),
    "int8": (5, np.dtype(np.int8)),
    "int16": (6, np.dtype(np.int16)),
    "int32": (7, np.dtype(np.int32)),
    "int64": (8, np.dtype(np.int64)),
    "uint8": (9, np.dtype(np.uint8)),
    "bool": (10, np.dtype(np.bool_)),
}
NAMES: tuple[str, ...] = tuple(_TABLE)
_BY_CODE = {code: name for name, (code, _) in _TABLE.items()}
FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})


def code_of(name: str) -> int:
    return _TABLE[name][0]


def name_of(code: int) -> str:
    return _BY_CODE.get(code, f"<unknown dtype code {code}>")


def storage(name: str) -> np.dtype:
    """The numpy dtype whose bytes hold a value of ``name``."""
    return _TABLE[name][1]


_KNOWN: dict[np.dtype, str] = {}  # numpy dtypes seen, by eRDMA name (numpy's .name is slow to compute)


def name_for_numpy(dtype: np.dtype) -> str:
    """Map a numpy dtype (ml_dtypes' bfloat16 included) to an eRDMA dtype name, or raise TypeError."""
    found = _KNOWN.get(dtype)
    if found is not None:
        return found
    name = np.dtype(dtype).name
    if name in _TABLE:
        _KNOWN[dtype] = name
        return name
    raise TypeError(f"unsupported dtype {name!r}; supported: {', '.join(NAMES)}")


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    """Round float32 to bfloat16 bits (nearest, ties to even; NaN stays NaN) into ``out``."""
    u = values.view(np.uint32)
    rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    nan = np.isnan(values)
    out[...] = np.where(nan, (u >> 16) | 0x0040, rounded).astype(np.uint16)
