"""R2: with no node configured, none reachable, a node that refuses the job, or one out of slots, every
naca collective runs the host algorithm, says why in the log and counts it."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import naca_config

from erdma_core.sdk import ConfigError
from erdma_core.testing.world import RankFailure, World


def collectives(pg: Any) -> dict[str, Any]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("erdma.collectives").addHandler(handler)
    x = np.arange(1000, dtype=np.int64) * (pg.rank() + 1)
    pg.allreduce(x)
    pg.allreduce(x)
    b = np.arange(10, dtype=np.float32) if pg.rank() == 0 else np.zeros(10, np.float32)
    pg.broadcast(b, src=0)
    o = np.empty(4, np.int32)
    pg.reduce_scatter(o, np.arange(4 * pg.size(), dtype=np.int32))
    logging.getLogger("erdma.collectives").removeHandler(handler)
    return {"x": x, "b": b, "o": o, "counters": pg.counters(), "log": records}


def check(results: list[dict[str, Any]], why: str) -> None:
    p = len(results)
    for r, res in enumerate(results):
        assert res["x"].tolist() == (np.arange(1000) * sum(range(1, p + 1)) * p).tolist()  # twice
        assert res["b"].tolist() == list(range(10))
        assert res["o"].tolist() == (np.arange(4 * p)[r * 4:(r + 1) * 4] * p).tolist()
        c = res["counters"]
        assert c["allreduce.naca.fallback.ring"] == 2 and c["broadcast.naca.fallback.tree"] == 1
        assert c["reduce_scatter.naca.fallback.ring"] == 1 and "allreduce.naca.offloaded" not in c
        assert why in res["log"][0], res["log"]
        assert "runs on the hosts with ring instead of naca" in res["log"][0]


def test_no_node_configured(secret_file: Path) -> None:
    with World(2, config=naca_config([], secret_file), timeout=60) as world:
        check(world.run(collectives), "no aggregation node configured")


def test_node_unreachable(secret_file: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a port nobody serves
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    cfg = naca_config([dead], secret_file, join_timeout=0.3)
    with World(3, config=cfg, timeout=60) as world:
        check(world.run(collectives), f"could not join {dead}")


def test_node_with_another_secret(start_node: Any, secret_file: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.secret"
    other.write_text("x" * 40)
    node = start_node(secret=other)
    with World(2, config=naca_config([node], secret_file), timeout=60) as world:
        check(world.run(collectives), "admission secret was not proved")


def test_node_out_of_slots(start_node: Any, secret_file: Path) -> None:
    node = start_node("--slots", "1")
    with World(2, config=naca_config([node], secret_file), timeout=60) as first:
        first.run(collectives_on_node)
        with World(2, config=naca_config([node], secret_file), timeout=60) as second:
            check(second.run(collectives), "the node has no free slots")


def collectives_on_node(pg: Any) -> None:
    x = np.ones(10, np.int64)
    pg.allreduce(x)
    assert x.tolist() == [pg.size()] * 10 and pg.counters()["allreduce.naca.offloaded"] == 1


def test_ranks_naming_different_nodes_are_refused(start_node: Any, secret_file: Path) -> None:
    node = start_node()
    with World(2, config=naca_config([node], secret_file), timeout=60) as world, \
            pytest.raises(RankFailure) as info:
        world.run(other_nodes, node.address)
    for r in (0, 1):
        assert isinstance(info.value.errors[r], ConfigError)
        assert "name different aggregation nodes" in str(info.value.errors[r])


def other_nodes(pg: Any, address: str) -> None:
    import os

    if pg.rank() == 1:
        os.environ["ERDMA_NACA_NODES"] = address + ",127.0.0.1:9"
    pg.allreduce(np.ones(3, np.float32))


@pytest.mark.parametrize("key, value, message", [
    ("nodes", "localhost", "'localhost' is not host:port"),
    ("nodes", "a:1,b:99999", "'b:99999' is not host:port"),
    ("secret_file", "", "secret_file is empty"),
    ("secret_file", "/nonexistent/secret", "/nonexistent/secret'"),
])
def test_bad_settings_name_the_key(key: str, value: str, message: str, secret_file: Path) -> None:
    from erdma_naca.options import OPTIONS, settings

    section = {k: o.default for k, o in OPTIONS.items()} | {"nodes": "127.0.0.1:7700",
                                                             "secret_file": str(secret_file), key: value}
    with pytest.raises(ConfigError, match=r"algorithm\.allreduce\.naca"):
        settings(section, environ={})
    with pytest.raises(ConfigError, match=message):
        settings(section, environ={})
