"""The lossy codecs' arithmetic, written once against the array API: ``xp`` is numpy for host arrays and
cupy for device arrays (``device.module_of``), so CI runs on numpy the very lines a GPU runs.

Every function takes and returns arrays of the same module. Values are worked on in float32 (float64 stays
float64); ``load`` and ``store`` convert from and to an eRDMA dtype's storage (bfloat16 travels as uint16
bits). Decoding is exact arithmetic (a cast, a shift, one multiply per element), so a host and a device
decode the same bytes to the same bits.
"""

from __future__ import annotations

from typing import Any

FLOATS = ("float16", "bfloat16", "float32", "float64")
FP16_MAX = 65504.0


def load(xp: Any, data: Any, dtype: str) -> Any:
    """A working copy of ``data`` (storage of ``dtype``): float32, or float64 for float64."""
    if dtype == "bfloat16":
        return (data.astype(xp.uint32) << 16).view(xp.float32)
    if dtype == "float64":
        return data.copy()
    return data.astype(xp.float32)


def store(xp: Any, values: Any, dtype: str) -> Any:
    """``values`` as ``dtype``'s storage (bfloat16: rounded to nearest even, as uint16 bits)."""
    if dtype == "bfloat16":
        return bf16_bits(xp, values.astype(xp.float32))
    return values.astype({"float16": xp.float16, "float32": xp.float32, "float64": xp.float64}[dtype])


def seen(xp: Any, values: Any, dtype: str) -> Any:
    """What a receiver holds after storing ``values`` as ``dtype``, as working values again."""
    return load(xp, store(xp, values, dtype), dtype)


# ---- casts ------------------------------------------------------------------------------------------------
def to_fp16(xp: Any, x: Any) -> Any:
    """float16 bits (uint16) of float32 ``x``, rounded to nearest even, finite values clipped to float16's range
    (an inf or nan stays what it is, so overflow checks such as torch's GradScaler still see it). The same bits
    as ``astype(float16)`` after the clip, done with integer operations: numpy's own cast runs at about
    50 MB/s, this at several hundred."""
    bits = x.view(xp.uint32)
    sign = (bits >> 16) & 0x8000
    mag = bits & 0x7FFFFFFF
    clipped = xp.minimum(mag, xp.uint32(0x477FE000))  # 65504 (finite values only: see the end)
    normal = ((clipped + 0xFFF + ((clipped >> 13) & 1)) >> 13) - ((127 - 15) << 10)
    below = clipped < 0x38800000  # under 2^-14: float16 subnormals, multiples of 2^-24
    small = xp.where(below, mag, xp.uint32(0)).view(xp.float32)
    h = xp.where(below, xp.rint(small * xp.float32(2.0 ** 24)).astype(xp.uint32), normal)
    h = xp.where(mag > 0x7F800000, xp.uint32(0x7E00), xp.where(mag == 0x7F800000, xp.uint32(0x7C00), h))
    return (h | sign).astype(xp.uint16)


def from_fp16(xp: Any, h: Any) -> Any:
    """float32 values of float16 bits ``h`` (uint16), exactly: a lookup in a table of all 65536."""
    table = _FP16_TABLES.get(xp.__name__)
    if table is None:
        table = _FP16_TABLES[xp.__name__] = fp16_values(xp, xp.arange(1 << 16, dtype=xp.uint32).astype(xp.uint16))
    return table[h]


_FP16_TABLES: dict[str, Any] = {}


def fp16_values(xp: Any, h: Any) -> Any:
    """float32 values of float16 bits ``h`` (uint16), computed."""
    h = h.astype(xp.uint32)
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    normal = ((exp + (127 - 15)) << 23) | (mant << 13)
    special = xp.uint32(0x7F800000) | (mant << 13)
    bits = xp.where(exp == 31, special, normal) | sign
    out = bits.view(xp.float32)
    sub = (mant.astype(xp.float32) * xp.float32(2.0 ** -24)) * xp.where(sign != 0, xp.float32(-1), xp.float32(1))
    return xp.where(exp == 0, sub, out)


def bf16_bits(xp: Any, x: Any) -> Any:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even; a nan stays a (quiet) nan."""
    bits = x.view(xp.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet = (bits >> 16) | 0x0040
    return xp.where(xp.isnan(x), quiet, rounded).astype(xp.uint16)


def from_bf16_bits(xp: Any, bits: Any) -> Any:
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


# ---- blockwise absmax ---------------------------------------------------------------------------------------
def levels(bits: int) -> int:
    """The largest code of a signed ``bits``-bit absmax quantizer: 127 for 8, 7 for 4."""
    return (1 << (bits - 1)) - 1


def absmax(xp: Any, x: Any, block: int, bits: int) -> tuple[Any, Any] | None:
    """(scales float32, codes int8 in [-L, L]) for ``x`` in blocks of ``block`` (the last one padded with
    zeros); None when a block holds an inf or nan (no scale represents it: the caller sends raw)."""
    n = x.size
    pad = (-n) % block
    blocks = xp.concatenate([x, xp.zeros(pad, x.dtype)]) if pad else x
    blocks = blocks.reshape(-1, block)
    top = xp.max(xp.abs(blocks), axis=1)
    if not bool(xp.all(xp.isfinite(top))):
        return None
    scale = (top / levels(bits)).astype(xp.float32)
    safe = xp.where(scale == 0, xp.float32(1), scale)
    q = xp.clip(xp.rint(blocks / safe[:, None]), -levels(bits), levels(bits)).astype(xp.int8)
    return scale, q.reshape(-1)


def unabsmax(xp: Any, scale: Any, codes: Any, n: int, block: int) -> Any:
    """float32 values from ``absmax``'s output (``codes`` int8, padded to whole blocks)."""
    return (codes.reshape(-1, block).astype(xp.float32) * scale[:, None]).reshape(-1)[:n]


def pack4(xp: Any, codes: Any) -> Any:
    """int8 codes in [-7, 7] -> bytes holding two codes each (low nibble first), offset by 8."""
    u = (codes.astype(xp.int16) + 8).astype(xp.uint8)
    if u.size % 2:
        u = xp.concatenate([u, xp.full(1, 8, xp.uint8)])
    return (u[0::2] | (u[1::2] << 4)).astype(xp.uint8)


def unpack4(xp: Any, packed: Any, n: int) -> Any:
    """``pack4``'s inverse: ``n`` int8 codes."""
    out = xp.empty(packed.size * 2, xp.int8)
    out[0::2] = (packed & 0x0F).astype(xp.int8) - 8
    out[1::2] = (packed >> 4).astype(xp.int8) - 8
    return out[:n]


# ---- top-k -----------------------------------------------------------------------------------------------------
def topk(xp: Any, x: Any, k: int) -> tuple[Any, Any]:
    """(indices uint32, ascending; their values) of the ``k`` elements of largest magnitude (a nan counts as
    largest, so it is sent)."""
    mag = xp.abs(x)
    mag = xp.where(xp.isnan(mag), xp.inf, mag)
    idx = xp.argpartition(mag, x.size - k)[x.size - k:] if k < x.size else xp.arange(x.size)
    idx = xp.sort(idx).astype(xp.uint32)
    return idx, x[idx]


def untopk(xp: Any, idx: Any, values: Any, n: int) -> Any:
    out = xp.zeros(n, values.dtype)
    out[idx] = values
    return out
