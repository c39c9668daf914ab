"""Bruck's allgather: its schedules checked without a network (every world size up to 9), then run."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from erdma_example.bruck import allgather

from erdma_core.sdk import Spec
from erdma_core.testing.schedules import simulate


@pytest.mark.parametrize("p", range(1, 10))
@pytest.mark.parametrize("n", [0, 1, 7, 100])
def test_schedules_gather_every_block_in_rank_order(p: int, n: int) -> None:
    bufs = [{"in": np.full(n, r + 1), "out": np.zeros(n * p, np.int64)} for r in range(p)]
    simulate(allgather, [Spec("allgather", r, p, n) for r in range(p)], bufs)
    for b in bufs:
        assert (b["out"] == np.repeat(np.arange(1, p + 1), n)).all()


def gather_with_bruck(pg: Any) -> bool:
    p = pg.size()
    mine = np.arange(50_000, dtype=np.float64) + pg.rank() * 1e6
    out = np.zeros(50_000 * p)
    pg.allgather(out, mine)
    return bool((out == np.concatenate([np.arange(50_000) + q * 1e6 for q in range(p)])).all())


@pytest.mark.parametrize("size", [2, 3, 5])
def test_bruck_in_a_job(erdma_world: Any, size: int) -> None:
    world = erdma_world(size, {"collectives.allgather": "bruck", "collectives.chunk_bytes": 65536})
    assert world.run(gather_with_bruck) == [True] * size
