"""Reduction operators and the kernel that applies one slice onto another."""

from __future__ import annotations

import enum

import numpy as np

from . import dtypes


class ReduceOp(enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    __hash__ = object.__hash__  # members are singletons; Enum's own hash is a Python call per lookup

    @property
    def code(self) -> int:
        """The op's code in a frame header's ``redop`` field (0: none); never renumbered."""
        return _CODES[self]


_CODES = {ReduceOp.SUM: 1, ReduceOp.PROD: 2, ReduceOp.MIN: 3, ReduceOp.MAX: 4, ReduceOp.AVG: 5, ReduceOp.BAND: 6,
          ReduceOp.BOR: 7, ReduceOp.BXOR: 8}
NAMES = {code: op.name for op, code in _CODES.items()}


_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # AVG sums on the wire and divides once at the end
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


def parse(op: ReduceOp | str) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp[str(op).upper()]
    except KeyError:
        choices = ", ".join(o.name for o in ReduceOp)
        raise ValueError(f"unknown reduce op {op!r}; valid choices: {choices}") from None


def check(op: ReduceOp, dtype: str) -> None:
    """Refuse a pairing with no meaning: AVG of booleans, bitwise ops on floating point."""
    if op is ReduceOp.AVG and dtype == "bool":
        raise TypeError("ReduceOp.AVG needs a numeric dtype, got bool")
    if op in BITWISE and dtype in dtypes.FLOATING:
        ints = ", ".join(n for n in dtypes.NAMES if n not in dtypes.FLOATING)
        raise TypeError(f"ReduceOp.{op.name} needs an integer or bool dtype ({ints}), got {dtype}")


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp, dtype: str) -> None:
    """dst = op(dst, src), elementwise, in the storage of ``dtype``. Deterministic for a given order."""
    ufunc = _UFUNC[op]
    if dtype == "bfloat16":
        dtypes.f32_to_bf16(ufunc(dtypes.bf16_to_f32(dst), dtypes.bf16_to_f32(src)), dst)
    elif dtype == "bool" and op is ReduceOp.SUM:
        np.logical_or(dst, src, out=dst)
    else:
        ufunc(dst, src, out=dst)


def needs_finish(op: ReduceOp) -> bool:
    """``op`` has a once-per-result step (``finish``)."""
    return op is ReduceOp.AVG


def finish(buf: np.ndarray, op: ReduceOp, dtype: str, world: int) -> None:
    """Apply the once-per-result step of ``op``: AVG divides the sum (in ``dtype``) by the world size once,
    rounding floats to ``dtype`` and truncating integers toward zero, as NCCL's integer average does."""
    if not needs_finish(op):
        return
    if dtype == "bfloat16":
        dtypes.f32_to_bf16(dtypes.bf16_to_f32(buf) / np.float32(world), buf)
    elif dtype in dtypes.FLOATING:
        np.true_divide(buf, world, out=buf, casting="unsafe")
    else:  # exact: the nearest multiple of world toward zero, divided (no float rounding of large int64)
        n = buf.dtype.type(world)
        np.floor_divide(buf - np.fmod(buf, n), n, out=buf)
