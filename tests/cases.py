"""Inputs and numpy references for the collective tests. Values are small integers, so every reduction
is exact in every dtype and the reference is bit-for-bit whatever the reduction order."""

from __future__ import annotations

import hashlib

import numpy as np

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
FLOATS = {"float16", "bfloat16", "float32", "float64"}
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]
BITWISE = {"band", "bor", "bxor"}
SIZES = [1, 7, 5003]


def storage(dtype: str) -> np.dtype:
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """Exact values (float64/int64/bool) -> storage of ``dtype``."""
    if dtype == "bfloat16":  # exact small values: bfloat16 is the top half of float32
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(storage(dtype))


def decode(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype == "bool":
        return arr.astype(bool)
    return arr.astype(np.float64 if dtype in FLOATS else np.int64)


def values(rank: int, n: int, dtype: str, op: str = "sum", seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, n, DTYPES.index(dtype)])
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if op == "prod":
        v = rng.integers(1, 3, n)
    elif dtype.startswith("uint") or dtype == "bool":
        v = rng.integers(0, 8, n)
    else:
        v = rng.integers(-4, 8, n)
    return v.astype(np.float64 if dtype in FLOATS else np.int64)


def make(rank: int, n: int, dtype: str, op: str = "sum", seed: int = 0) -> np.ndarray:
    return encode(values(rank, n, dtype, op, seed), dtype)


def reduce_ref(inputs: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """The reduction of exact values, then stored in ``dtype`` (ints wrap as the dtype does)."""
    stack = np.stack(inputs)
    if dtype == "bool":
        return {"sum": stack.any(0), "prod": stack.all(0), "min": stack.all(0), "max": stack.any(0),
                "band": stack.all(0), "bor": stack.any(0), "bxor": stack.sum(0) % 2 == 1}[op]
    if op in BITWISE:  # on int64 values: the low bits of a bitwise result are the bitwise result of low bits
        ufunc = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
        return ufunc.reduce(stack.astype(np.int64), axis=0).astype(storage(dtype))
    if op in ("sum", "avg"):
        exact = stack.sum(0)
    elif op == "prod":
        exact = stack.prod(0)
    else:
        exact = stack.min(0) if op == "min" else stack.max(0)
    result = encode(exact, dtype) if dtype in FLOATS else exact.astype(storage(dtype))
    if op == "avg":
        result = avg_ref(result, dtype, len(inputs))
    return result


def applies(op: str, dtype: str) -> bool:
    """Whether ``op`` is defined on ``dtype`` (no AVG of booleans, no bitwise ops on floating point)."""
    return not ((op == "avg" and dtype == "bool") or (op in BITWISE and dtype in FLOATS))


def avg_ref(summed: np.ndarray, dtype: str, world: int) -> np.ndarray:
    """AVG's contract: the sum in ``dtype``, divided once by the world size, rounded to ``dtype``; integers
    truncate toward zero (as NCCL's integer average does), computed here one Python int at a time."""
    if dtype not in FLOATS:
        return np.array([int(v) // world if v >= 0 else -(-int(v) // world) for v in summed], summed.dtype)
    if dtype == "bfloat16":
        import torch

        f32 = torch.from_numpy(decode(summed, dtype).astype(np.float32)) / world
        return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return (summed.astype(np.float64) / world).astype(dtype) if dtype == "float64" else \
        np.true_divide(summed, np.array(world, dtype=summed.dtype))


def digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()[:16]


def same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
