"""Recursive doubling: its schedules checked without a network (every world size up to 9), then run."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from erdma_example.doubling import allreduce

from erdma_core.algorithms.schedule import Spec
from erdma_core.testing.schedules import simulate


@pytest.mark.parametrize("p", range(1, 10))
@pytest.mark.parametrize("n", [0, 1, 7, 100])
def test_schedules_sum_on_every_rank(p: int, n: int) -> None:
    bufs = [{"out": np.arange(n, dtype=np.int64) * (r + 1)} for r in range(p)]
    simulate(allreduce, [Spec("allreduce", r, p, n) for r in range(p)], bufs)
    for b in bufs:
        assert (b["out"] == np.arange(n) * (p * (p + 1) // 2)).all()


def reduce_with_doubling(pg: Any) -> tuple[bool, str]:
    ints = np.arange(100_000, dtype=np.int64) * (pg.rank() + 1)
    pg.allreduce(ints, algorithm="doubling")
    floats = np.random.default_rng(pg.rank()).standard_normal(100_000)
    pg.allreduce(floats, algorithm="doubling")
    p = pg.size()
    return bool((ints == np.arange(100_000) * (p * (p + 1) // 2)).all()), floats.tobytes().hex()[:64]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_doubling_in_a_job(erdma_world: Any, size: int) -> None:
    results = erdma_world(size, {"collectives.allreduce": "doubling", "collectives.chunk_bytes": 65536}).run(
        reduce_with_doubling)
    assert all(ok for ok, _ in results)
    assert len({bits for _, bits in results}) == 1  # partners add the same two values: identical everywhere
