"""allreduce, broadcast and reduce_scatter through a real aggregation node (``erdma naca serve``) with 2-8
ranks: results equal, byte for byte, the rank-order reduction numpy computes, and every chunk went
through the node (the group's counters say so)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import naca_config

from erdma_core.sdk import MismatchError
from erdma_core.testing.world import RankFailure, World

SIZES = (0, 1, 1000, 5000, 70_001)  # 70001 float32: 35 chunks of 8 KiB, more than fit one datagram each


def inputs(rank: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + n)
    if dtype.startswith("float"):
        return (rng.standard_normal(n) * 10 ** (rank % 3)).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def rank_order(xs: list[np.ndarray], op: Any = np.add) -> np.ndarray:
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = op(acc, x)
    return acc


def job(pg: Any) -> dict[str, Any]:
    r, p = pg.rank(), pg.size()
    out: dict[str, Any] = {}
    for n in SIZES:
        for dtype in ("float32", "int64", "float64"):
            x = inputs(r, n, dtype)
            pg.allreduce(x)
            out[("sum", n, dtype)] = x
        y = inputs(r, n, "float32")
        pg.allreduce(y, op="max")
        out[("max", n)] = y
        z = inputs(r, n, "float64")
        pg.allreduce(z, op="avg")
        out[("avg", n)] = z
        b = inputs(r, n, "int64") if r == p - 1 else np.zeros(n, np.int64)
        pg.broadcast(b, src=p - 1)
        out[("bcast", n)] = b
        full = np.concatenate([inputs(r * 10 + q, n, "float32") for q in range(p)])
        o = np.empty(n, np.float32)
        pg.reduce_scatter(o, full)
        out[("rs", n)] = o
    out["counters"] = pg.counters()
    return out


@pytest.mark.parametrize("size", [2, 4, 8])
def test_exact_results_through_the_node(size: int, start_node: Any, secret_file: Path) -> None:
    node = start_node()
    with World(size, config=naca_config([node], secret_file), timeout=120) as world:
        results = world.run(job)
    for n in SIZES:
        for dtype in ("float32", "int64", "float64"):
            want = rank_order([inputs(q, n, dtype) for q in range(size)])
            assert all(res[("sum", n, dtype)].tobytes() == want.tobytes() for res in results), (n, dtype)
        want_max = rank_order([inputs(q, n, "float32") for q in range(size)], np.maximum)
        want_avg = rank_order([inputs(q, n, "float64") for q in range(size)]) / size
        want_b = inputs(size - 1, n, "int64")
        for r, res in enumerate(results):
            assert res[("max", n)].tobytes() == want_max.tobytes()
            assert res[("avg", n)].tobytes() == want_avg.tobytes()
            assert res[("bcast", n)].tobytes() == want_b.tobytes()
            fulls = [np.concatenate([inputs(q * 10 + k, n, "float32") for k in range(size)]) for q in range(size)]
            want_rs = rank_order(fulls)[r * n:(r + 1) * n]
            assert res[("rs", n)].tobytes() == want_rs.tobytes(), (r, n)
    calls = len(SIZES)
    for res in results:
        c = res["counters"]
        assert {k: v for k, v in c.items() if not k.startswith("naca.")} == {
            "allreduce.naca.offloaded": 5 * calls, "broadcast.naca.offloaded": calls,
            "reduce_scatter.naca.offloaded": calls}
        assert c["naca.failovers"] == 0 and c["naca.datagrams_received"] >= 7 * calls
    stats = node.stop()
    assert " 0 bad tags, 0 malformed" in stats, stats


def mismatched(pg: Any) -> None:
    pg.allreduce(np.ones(10 + pg.rank(), np.float32))


def test_ranks_that_disagree_fail_with_mismatch(start_node: Any, secret_file: Path) -> None:
    node = start_node()
    with World(2, config=naca_config([node], secret_file), timeout=60) as world, \
            pytest.raises(RankFailure) as info:
        world.run(mismatched)
    for r in (0, 1):
        err = info.value.errors[r]
        assert isinstance(err, MismatchError), err
        assert f"rank {r}: allreduce (group 0, seq 1) via aggregation node {node.address}" in str(err)
        assert "contributions disagree" in str(err)


def subgroup(pg: Any) -> Any:
    g = pg.new_group([0, 2])
    x = np.full(100, pg.rank() + 1, np.int32)
    if g is not None:
        g.allreduce(x)
    pg.allreduce(np.ones(3, np.int32))
    y = np.full(5, pg.rank(), np.int32)
    pg.allreduce(y)
    return x, y


def test_groups_of_one_job_aggregate_apart(start_node: Any, secret_file: Path) -> None:
    node = start_node()
    with World(3, config=naca_config([node], secret_file), timeout=60) as world:
        results = world.run(subgroup)
    assert results[0][0].tolist() == [4] * 100 and results[2][0].tolist() == [4] * 100
    assert results[1][0].tolist() == [2] * 100
    assert all(y.tolist() == [3] * 5 for _, y in results)
