"""R11: the active aggregation node is killed (SIGKILL) while the ranks run allreduces; they fail over to
the next node, or to the host ring when there is none, and every collective still completes with the
same result on every rank."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import naca_config

from erdma_core.testing.world import World

ITERS = 60


def steps(pg: Any, n: int, node_pid: int) -> dict[str, Any]:
    """ITERS allreduces: exact integers (any summation order gives the same) and floats (the same bits on
    every rank whatever served them), with each float result's hash. Rank 0 kills the node 20 ms into
    iteration ITERS // 2 (the others are in that allreduce or the one before)."""
    r = pg.rank()
    hashes, ints = [], []
    for i in range(ITERS):
        if r == 0 and i == ITERS // 2:
            threading.Timer(0.02, os.kill, (node_pid, signal.SIGKILL)).start()
        x = np.full(n, (r + 1) * (i + 1), np.int64)
        pg.allreduce(x)
        ints.append(bool((x == (i + 1) * pg.size() * (pg.size() + 1) // 2).all()))
        y = np.random.default_rng(i * 100 + r).standard_normal(n).astype(np.float32)
        pg.allreduce(y)
        hashes.append(hashlib.sha256(y.tobytes()).hexdigest())
    return {"ints": ints, "hashes": hashes, "counters": pg.counters()}


def run_with_kill(world: World, node: Any, n: int) -> list[dict[str, Any]]:
    results = world.run(steps, n, node.proc.pid)
    node.proc.wait(10)
    return results


@pytest.mark.parametrize("n", [10, 100_000])
def test_killed_node_fails_over_to_the_next(n: int, start_node: Any, secret_file: Path) -> None:
    first, second = start_node(), start_node()
    cfg = naca_config([first, second], secret_file, node_timeout=0.5, join_timeout=0.3)
    with World(4, config=cfg, timeout=120) as world:
        results = run_with_kill(world, first, n)
    assert first.proc.poll() is not None  # it was killed while they ran
    for res in results:
        assert all(res["ints"])
        assert res["hashes"] == results[0]["hashes"]
        c = res["counters"]
        assert c["naca.failovers"] == 1, c
        assert c["allreduce.naca.offloaded"] == 2 * ITERS and "allreduce.naca.fallback" not in c
    assert " 0 bad tags" in second.stop()


def test_killed_last_node_falls_back_to_the_ring(start_node: Any, secret_file: Path) -> None:
    node = start_node()
    cfg = naca_config([node], secret_file, node_timeout=0.5, join_timeout=0.3)
    with World(3, config=cfg, timeout=120) as world:
        results = run_with_kill(world, node, 20_000)
    for res in results:
        assert all(res["ints"])
        assert res["hashes"] == results[0]["hashes"]
        c = res["counters"]
        assert c["naca.failovers"] == 1
        assert 0 < c["allreduce.naca.offloaded"] < 2 * ITERS
        assert c["allreduce.naca.offloaded"] + c["allreduce.naca.fallback.ring"] == 2 * ITERS


def half_finished(pg: Any, op: str, node_pid: int) -> list[np.ndarray]:
    """Rank 3 stops hearing results in iteration 3 (as if they were lost); the others finish it, and rank 0
    kills the node as iteration 4 starts. At the failover rank 3 is one collective behind the others."""
    from erdma_naca import header as H

    r = pg.rank()
    out = []
    for i in range(7):
        if i == 3 and r == 3:
            (naca,) = pg.offloads.objects()
            link = naca.links[naca.active]
            def deaf(timeout: float, hear: Any = link._recv) -> bytes | None:
                d = hear(timeout)
                return None if d is not None and H.peek(d).kind == H.RESULT else d

            link._recv = deaf
        if i == 4 and r == 0:
            os.kill(node_pid, signal.SIGKILL)
        x = np.random.default_rng(10 * i + r).standard_normal(300).astype(np.float32)
        if op == "allreduce":
            pg.allreduce(x)
            out.append(x)
        elif op == "broadcast":
            pg.broadcast(x, src=1)
            out.append(x)
        else:
            o = np.empty(75, np.int64)
            pg.reduce_scatter(o, (x * 100).astype(np.int64))
            out.append(o)
    out.append(pg.counters())
    return out


@pytest.mark.parametrize("op", ["allreduce", "broadcast", "reduce_scatter"])
def test_rank_that_missed_results_gets_them_after_failover(op: str, start_node: Any, secret_file: Path) -> None:
    first, second = start_node(), start_node()
    cfg = naca_config([first, second], secret_file, node_timeout=0.5, join_timeout=0.3)
    with World(4, config=cfg, timeout=120) as world:
        results = world.run(half_finished, op, first.proc.pid)
    for r, res in enumerate(results):
        *values, c = res
        assert c["naca.failovers"] == 1 and c["naca.settled"] == 1, (r, c)
        for i, v in enumerate(values):
            xs = [np.random.default_rng(10 * i + q).standard_normal(300).astype(np.float32) for q in range(4)]
            if op == "allreduce":
                want = ((xs[0] + xs[1]) + xs[2]) + xs[3]  # the nodes' order, also for the forwarded result
            elif op == "broadcast":
                want = xs[1]
            else:
                want = sum((x * 100).astype(np.int64) for x in xs)[r * 75:(r + 1) * 75]
            assert v.tobytes() == want.tobytes(), (r, i)


def late(pg: Any, delay: float) -> tuple[list[bool], dict[str, Any]]:
    """Three allreduces; before each, the last rank comes ``delay`` seconds after the others."""
    ok = []
    for i in range(3):
        if pg.rank() == pg.size() - 1:
            time.sleep(delay)
        x = np.full(50_000, pg.rank() + i, np.int64)
        pg.allreduce(x)
        ok.append(bool((x == sum(range(pg.size())) + pg.size() * i).all()))
    return ok, pg.counters()


def test_a_late_rank_is_waited_for_not_taken_for_a_dead_node(start_node: Any, secret_file: Path) -> None:
    """The node holds the early ranks' chunks (PENDING) while the last rank is 3 node timeouts late: the
    early ranks keep probing (every node_timeout / 4, also before any round trip was measured, below
    rto_max) and the node answers, so nobody fails over."""
    node = start_node()
    cfg = naca_config([node], secret_file, node_timeout=1.0, join_timeout=0.3, rto_max_ms=2000.0)
    with World(3, config=cfg, timeout=120) as world:
        results = world.run(late, 3.0)
    for ok, c in results:
        assert ok == [True] * 3
        assert c["naca.failovers"] == 0 and c["allreduce.naca.offloaded"] == 3, c
    assert " 0 bad tags" in node.stop()


def deaf(pg: Any) -> tuple[list[bool], dict[str, Any]]:
    """Three allreduces; during the second the last rank hears nothing from the node (its path in breaks)
    while the node and the other ranks are fine."""
    from erdma_naca import link

    ok = []
    hear = link.Link._recv
    for i in range(3):
        if pg.rank() == pg.size() - 1:
            link.Link._recv = (lambda self, timeout: time.sleep(min(timeout, 0.05))) if i == 1 else hear
        x = np.full(50_000, pg.rank() + i, np.int64)
        pg.allreduce(x)
        ok.append(bool((x == sum(range(pg.size())) + pg.size() * i).all()))
    return ok, pg.counters()


def test_a_rank_that_alone_finds_the_node_silent_takes_every_rank_into_the_failover(start_node: Any,
                                                                                   secret_file: Path) -> None:
    """The deaf rank gives the collective up after node_timeout and tells the node (LEAVE, GIVE_UP): the
    node forgets the job, the ranks waiting there are told so at their next probe and fail over too, and
    all of them finish on the hosts and come back to the node. Without the GIVE_UP the others would hear
    PENDING until the collective timeout while the deaf rank waits for them in the failover."""
    node = start_node()
    cfg = naca_config([node], secret_file, node_timeout=2.0, join_timeout=2.0, reprobe_after=1) | {
        "timeouts.collective": 30.0}
    with World(3, config=cfg, timeout=60) as world:
        results = world.run(deaf)
    for ok, c in results:
        assert ok == [True] * 3
        assert c["naca.failovers"] == 1, c
    assert " 1 given up" in node.stop()
