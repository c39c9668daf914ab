"""``reduce.c``, the compiled path's reductions, against numpy's on the host (no RDMA device needed): every
pairing it offers, byte for byte, on random values and on each type's edges (wrap-around, NaN, infinities,
signed zeros); the pairings it leaves to the core (floating-point minimum and maximum, other dtypes) refused."""

from __future__ import annotations

import numpy as np
import pytest

lib = pytest.importorskip("erdma_verbs._ibv", reason="the C side was not built (no libibverbs-dev)").lib
ffi = pytest.importorskip("erdma_verbs._ibv").ffi

OPS = {"sum": (lib.EV_SUM, np.add), "prod": (lib.EV_PROD, np.multiply), "min": (lib.EV_MIN, np.minimum),
       "max": (lib.EV_MAX, np.maximum), "band": (lib.EV_BAND, np.bitwise_and), "bor": (lib.EV_BOR, np.bitwise_or),
       "bxor": (lib.EV_BXOR, np.bitwise_xor)}
INTEGERS = {"int8": lib.EV_INT8, "uint8": lib.EV_UINT8, "int16": lib.EV_INT16, "uint16": lib.EV_UINT16,
            "int32": lib.EV_INT32, "uint32": lib.EV_UINT32, "int64": lib.EV_INT64, "uint64": lib.EV_UINT64}
FLOATS = {"float32": lib.EV_FLOAT32, "float64": lib.EV_FLOAT64}


def _operands(dtype: str, n: int = 4099) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    if dtype in FLOATS:
        a, b = rng.standard_normal(n).astype(dtype) * 1e3, rng.standard_normal(n).astype(dtype) * 1e3
        edges = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, np.finfo(dtype).max, np.finfo(dtype).tiny], dtype)
    else:
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        b = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        edges = np.array([info.min, info.max, 0, 1, info.max // 2 + 1, info.min + 1, info.max - 1], dtype)
    # every pair of edges, next to each other
    a[:edges.size ** 2], b[:edges.size ** 2] = np.repeat(edges, edges.size), np.tile(edges, edges.size)
    return a, b


def _reduce(a: np.ndarray, b: np.ndarray, op: int, dtype: int) -> tuple[int, np.ndarray]:
    out = a.copy()
    return lib.ev_reduce(ffi.from_buffer(out), ffi.from_buffer(b), out.nbytes, op, dtype), out


OFFERED = [(d, op) for d in INTEGERS for op in OPS] + [(d, op) for d in FLOATS for op in ("sum", "prod")]


@pytest.mark.parametrize(("dtype", "op"), OFFERED)
def test_what_it_offers_is_numpys_reduction(dtype: str, op: str) -> None:
    """Integers: every op, wrapping as numpy does. float32 and float64: sum and product."""
    code, ufunc = OPS[op]
    a, b = _operands(dtype)
    assert lib.ev_reducible(code, {**INTEGERS, **FLOATS}[dtype]) == 1
    with np.errstate(all="ignore"):
        want = ufunc(a, b)
    rc, got = _reduce(a, b, code, {**INTEGERS, **FLOATS}[dtype])
    assert rc == 0 and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("op", ["min", "max", "band", "bor", "bxor"])
@pytest.mark.parametrize("dtype", list(FLOATS))
def test_the_rest_is_left_to_the_core(dtype: str, op: str) -> None:
    assert lib.ev_reducible(OPS[op][0], FLOATS[dtype]) == 0
    a, b = _operands(dtype)
    assert _reduce(a, b, OPS[op][0], FLOATS[dtype])[0] == -1
    assert lib.ev_reducible(lib.EV_SUM, 0) == 0 and lib.ev_reducible(0, lib.EV_INT32) == 0
