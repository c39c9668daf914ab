"""``auto`` picks the aggregation node for an allreduce of at most ``auto_max_bytes`` where nodes are named,
and the core's choice above it, on every rank alike; results stay exact either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from erdma_core.sdk import ConfigError
from erdma_core.testing.world import RankFailure, World

SMALL, LARGE = 1000, 3000  # int64 elements: 8,000 and 24,000 bytes


def job(pg: Any) -> dict[str, Any]:
    out = {}
    for n in (SMALL, LARGE, SMALL):
        x = np.arange(n, dtype=np.int64) * (pg.rank() + 1)
        pg.allreduce(x)
        out[n] = x
    out["counters"] = {k: v for k, v in pg.counters().items() if not k.startswith("naca.")}
    return out


def config(node: Any, secret_file: Path | None, **extra: Any) -> dict[str, Any]:
    cfg = {"algorithm.allreduce.naca.nodes": node.address, "algorithm.allreduce.naca.join_timeout": 10.0,
           "timeouts.collective": 60.0}  # (a JOIN answered late on a busy machine must not make a group fall back)
    if secret_file is not None:
        cfg["algorithm.allreduce.naca.secret_file"] = str(secret_file)
    return cfg | {f"algorithm.allreduce.naca.{k}": v for k, v in extra.items()}


@pytest.mark.parametrize("limit, ranks, offloaded", [(10_000, 3, 2), (0, 2, 0), (100_000, 2, 3), (100_000, 4, 0),
                                                    (100_000, None, 0)])
def test_auto_takes_the_node_up_to_auto_max_bytes_from_auto_min_ranks(limit: int, ranks: int | None,
                                                                      offloaded: int, start_node: Any,
                                                                      secret_file: Path) -> None:
    """Three ranks: the node up to ``auto_max_bytes`` where ``auto_min_ranks`` is at most 3 (by default it is
    8, so never)."""
    node = start_node()
    extra = {"auto_max_bytes": limit} | ({"auto_min_ranks": ranks} if ranks is not None else {})
    with World(3, config=config(node, secret_file, **extra), timeout=60) as world:
        results = world.run(job)
    for n in (SMALL, LARGE):
        want = np.arange(n, dtype=np.int64) * 6
        assert all(res[n].tobytes() == want.tobytes() for res in results)
    for res in results:
        assert res["counters"] == ({"allreduce.naca.offloaded": offloaded} if offloaded else {})
    stats = node.stop()
    assert " 0 bad tags, 0 malformed" in stats, stats


def test_auto_with_no_node_named_leaves_the_choice_to_the_core(secret_file: Path) -> None:
    with World(2, config={"algorithm.allreduce.naca.secret_file": str(secret_file)}, timeout=60) as world:
        results = world.run(job)
    assert all(res["counters"] == {} and res[SMALL].tobytes() == (np.arange(SMALL) * 3).tobytes()
               for res in results)


def test_auto_with_a_node_named_and_no_secret_file_is_a_config_error_naming_the_key(start_node: Any) -> None:
    node = start_node()
    with World(2, config=config(node, None, auto_min_ranks=2), timeout=60) as world, \
            pytest.raises(RankFailure) as info:
        world.run(job)
    for r in (0, 1):
        err = info.value.errors[r]
        assert isinstance(err, ConfigError), err
        assert "algorithm.allreduce.naca.secret_file is empty" in str(err)
