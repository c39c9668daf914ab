"""The float16 compressor: what it does to one array, error feedback across steps, and a job compressed
with it (every rank gets the same bits)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from erdma_example.half import Half

from erdma_core.sdk import Site
from erdma_core.testing.compressor_conformance import CompressorConformance

SITE = Site(key="grad", op="allreduce", algorithm="ring", step=0, offset=0, count=4)


def round_trip(h: Half, x: np.ndarray, site: Site | None) -> np.ndarray:
    enc = h.encode(x, str(x.dtype), site)
    assert enc is not None
    out = np.empty_like(x)
    h.decode(memoryview(enc.payload).cast("B"), enc.meta, str(x.dtype), out)
    return out


def test_float16_on_the_wire_and_other_dtypes_raw():
    h = Half(None, {"error_feedback": False})
    x = np.array([0.1, 1.0, 70000.0, -1e9], np.float32)
    enc = h.encode(x, "float32", None)
    assert enc is not None and len(memoryview(enc.payload).cast("B")) == 8  # half the bytes
    assert round_trip(h, x, None).tolist() == [np.float32(np.float16(0.1)), 1.0, 65504.0, -65504.0]
    assert h.encode(np.arange(4, dtype=np.int32), "int32", None) is None


def test_error_feedback_carries_the_rounding_into_the_next_step():
    h = Half(None, {"error_feedback": True})
    x = np.full(4, 0.1, np.float32)
    sent = [round_trip(h, x, SITE) for _ in range(100)]
    assert np.float32(np.float16(0.1)) != np.float32(0.1)
    assert abs(np.mean(sent) - 0.1) < 1e-6 < abs(sent[0][0] - 0.1)  # the average comes back to 0.1
    big = np.full(4, 70000.0, np.float32)  # clipped to 65504, the rest follows in the next step
    first, second = round_trip(h, big, SITE.__class__("big", "allreduce", "ring", 0, 0, 4)), None
    second = round_trip(h, big, SITE.__class__("big", "allreduce", "ring", 0, 0, 4))
    assert first[0] == 65504.0 and second[0] == 65504.0  # 70000 + 4496 clipped again, the residual grows
    no_site = [round_trip(h, x, None) for _ in range(3)]
    assert all(np.array_equal(s, no_site[0]) for s in no_site)  # without a site nothing is kept


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()[:16]


def compressed_job(pg: Any) -> dict[str, str]:
    rng = np.random.default_rng(pg.rank())
    out = {}
    for algo in ("ring", "halving_doubling", "recursive_doubling", "tree"):
        a = rng.standard_normal(50_000).astype(np.float32)
        pg.allreduce(a, algorithm=algo)
        out[algo] = digest(a)
    g = np.zeros(30_000 * pg.size(), np.float32)
    pg.allgather(g, np.full(30_000, pg.rank() + 0.1, np.float32))
    out["allgather"] = digest(g)
    b = rng.standard_normal(40_000)
    pg.broadcast(b, src=pg.size() - 1)
    out["broadcast"] = digest(b)
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_a_compressed_job_leaves_every_rank_with_the_same_bits(erdma_world: Any, size: int) -> None:
    world = erdma_world(size, {"compression.name": "half", "compression.min_bytes": 1024,
                               "collectives.chunk_bytes": 65536})
    results = world.run(compressed_job)
    assert all(r == results[0] for r in results)


class TestHalfConformance(CompressorConformance):
    """The core's compressor conformance kit, as a third party's compressor runs it."""

    compressor, encodes, tolerance = "half", ("float32", "float64"), 1e-3
