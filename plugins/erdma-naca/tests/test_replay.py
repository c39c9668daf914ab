"""Someone on the path between the ranks and their aggregation nodes records every datagram the ranks send
and sends each again, twice, from an address of its own (``Tap``), into the node it was meant for and into
the standby node: no result goes to it, it gets back no more bytes than it sent, the standby takes none of
it after a failover, and every collective's result is right. A job idle longer than the node's ``--idle``,
and a job that fell back to the hosts, go back to the node."""

from __future__ import annotations

import collections
import os
import select
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from conftest import naca_config
from erdma_naca import header as H

from erdma_core.testing.world import World


class Tap:
    """A UDP relay in front of one node (ranks name ``address`` as the node): each rank's datagrams go on to
    the node from a socket of that rank's own and the node's answers come back, and every datagram from a
    rank is also sent ``copies`` times, from the attacker's socket, to each of ``replay_to`` (host, port);
    with ``keep``, the last ``keep`` datagrams are sent to them again every 50 ms, for as long as the tap runs.
    ``sent``/``received``: the attacker's bytes each way; ``kinds``: the NACA kinds it was answered with."""

    def __init__(self, node: tuple[str, int], replay_to: list[tuple[str, int]], copies: int = 2,
                 keep: int = 0) -> None:
        self.node, self.replay_to, self.copies = node, replay_to, copies
        self.kept: collections.deque[bytes] = collections.deque(maxlen=keep or 1)
        self.keep = keep
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.front.getsockname()[1]}"
        self.attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.attacker.bind(("127.0.0.1", 0))
        self.sent = self.received = 0
        self.kinds: list[int] = []
        self._back: dict[socket.socket, tuple[str, int]] = {}  # upstream socket -> the rank it serves
        self._up: dict[tuple[str, int], socket.socket] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _replay(self, data: bytes, copies: int) -> None:
        for target in self.replay_to:
            for _ in range(copies):
                self.sent += len(data)
                self.attacker.sendto(data, target)

    def _run(self) -> None:
        again = time.monotonic()
        while not self._stop:
            ready, _, _ = select.select([self.front, self.attacker, *self._back], [], [], 0.05)
            if self.keep and time.monotonic() >= again:
                again = time.monotonic() + 0.05
                for data in list(self.kept):
                    self._replay(data, 1)
            for sock in ready:
                data, addr = sock.recvfrom(1 << 16)
                if sock is self.front:
                    up = self._up.get(addr)
                    if up is None:
                        up = self._up[addr] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                        self._back[up] = addr
                    up.sendto(data, self.node)
                    self._replay(data, self.copies)
                    if self.keep:
                        self.kept.append(data)
                elif sock is self.attacker:
                    self.received += len(data)
                    self.kinds.append(H.peek(data).kind)
                else:
                    self.front.sendto(data, self._back[sock])

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        for s in [self.front, self.attacker, *self._back]:
            s.close()


def node_addr(node: Any) -> tuple[str, int]:
    return ("127.0.0.1", node.port)


def steps(pg: Any, n: int, kill: int | None, at: int) -> dict[str, Any]:
    """40 allreduces of ``n`` exact integers and a broadcast; rank 0 kills process ``kill`` at step ``at``."""
    r, p = pg.rank(), pg.size()
    right = []
    for i in range(40):
        if kill is not None and r == 0 and i == at:
            os.kill(kill, signal.SIGKILL)
        x = np.arange(n, dtype=np.int64) * (r + 1) + i
        pg.allreduce(x)
        right.append(bool(np.array_equal(x, np.arange(n) * (p * (p + 1) // 2) + p * i)))
    b = np.arange(n, dtype=np.int32) if r == 0 else np.zeros(n, np.int32)
    pg.broadcast(b, src=0)
    right.append(bool(np.array_equal(b, np.arange(n))))
    return {"right": right, "counters": pg.counters()}


def test_replays_divert_nothing_and_amplify_nothing(start_node: Any, secret_file: Path) -> None:
    node = start_node()
    tap = Tap(node_addr(node), [node_addr(node)])
    try:
        with World(2, config=naca_config([tap.address], secret_file), timeout=120) as world:
            results = world.run(steps, 20_000, None, 0)
    finally:
        tap.close()
    for res in results:
        assert all(res["right"]) and res["counters"]["allreduce.naca.offloaded"] == 40
    assert tap.sent > 100_000  # every datagram went again, twice
    assert not {H.RESULT, H.DONE, H.PENDING, H.JOIN_OK} & set(tap.kinds), tap.kinds  # no result diverted
    assert tap.received <= tap.sent  # amplification at most 1 (the answers: CHALLENGEs of replayed JOINs)
    stopped = node.stop()
    assert " 0 replays" not in stopped and " 0 bad tags" in stopped, stopped


def test_replays_into_the_standby_do_not_break_a_failover(start_node: Any, secret_file: Path) -> None:
    active, standby = start_node(), start_node()
    # the datagrams last sent to the killed node go on arriving at the standby while it serves the job
    tap = Tap(node_addr(active), [node_addr(standby), node_addr(active)], keep=16)
    cfg = naca_config([tap.address, standby.address], secret_file, node_timeout=0.5, join_timeout=0.3)
    try:
        with World(3, config=cfg, timeout=120) as world:
            results = world.run(steps, 20_000, active.proc.pid, 20)
    finally:
        tap.close()
    for res in results:
        assert all(res["right"]), res
        c = res["counters"]
        assert c["naca.failovers"] == 1 and c["allreduce.naca.offloaded"] == 40, c
    assert tap.received <= tap.sent
    assert " 0 bad tags" not in standby.stop()  # what was meant for the other node, dropped


def allreduces(pg: Any, n: int, count: int) -> dict[str, Any]:
    """``n`` allreduces of ``count`` exact integers: whether each was right, and the counters after."""
    right = []
    for _ in range(n):
        y = np.full(count, pg.rank() + 1, np.int64)
        pg.allreduce(y)
        right.append(bool((y == sum(range(1, pg.size() + 1))).all()))
    return {"right": right, "counters": pg.counters()}


def idle_then_more(pg: Any, pause: float) -> dict[str, Any]:
    """An allreduce, a pause, 8 more: 50 chunks each, so that the node's REJECTs of the chunks of the job it
    forgot outnumber what the first one needed (the rest are still there when the rank JOINs again)."""
    pg.allreduce(np.ones(50_000, np.int64))
    before = pg.counters()
    time.sleep(pause)  # the node forgets the job meanwhile
    return allreduces(pg, 8, 50_000) | {"before": before}


def late_then_more(pg: Any, pause: float) -> dict[str, Any]:
    """Rank 1 starts its first allreduce ``pause`` seconds after rank 0 (which JOINs and waits for it)."""
    if pg.rank() == 1:
        time.sleep(pause)
    return allreduces(pg, 4, 50_000)


def test_a_job_idle_longer_than_the_node_remembers_goes_back_to_it(start_node: Any, secret_file: Path) -> None:
    node = start_node("--idle", "1")
    with World(2, config=naca_config([node], secret_file), timeout=120) as world:
        results = world.run(idle_then_more, 3.0)
    for res in results:
        c, before = res["counters"], res["before"]
        # counted from after the first allreduce: on a busy host the ranks' first JOINs can be over a second
        # apart, and the node forgets the first before the second comes (the next test)
        assert all(res["right"]) and c["allreduce.naca.offloaded"] - before["allreduce.naca.offloaded"] == 8, c
        assert c["naca.failovers"] - before.get("naca.failovers", 0) == 1, (before, c)
        assert not any(k.startswith("allreduce.naca.fallback") for k in c), c


def test_a_job_forgotten_between_its_ranks_joins_fails_over_once(start_node: Any, secret_file: Path) -> None:
    """Rank 1 comes to its first allreduce after the node forgot rank 0's JOIN: the node takes rank 1's JOIN
    as a new job; rank 0's DATA ends it (unknown job), and both ranks fail over to it together (before, rank 1
    waited for rank 0's contribution until the collective's timeout)."""
    node = start_node("--idle", "1")
    with World(2, config=naca_config([node], secret_file) | {"timeouts.collective": 30.0}, timeout=120) as world:
        results = world.run(late_then_more, 3.0)
    for res in results:
        c = res["counters"]
        assert all(res["right"]) and c["allreduce.naca.offloaded"] == 4 and c["naca.failovers"] == 1, c
        assert not any(k.startswith("allreduce.naca.fallback") for k in c), c
    assert " 0 for unknown jobs" not in node.stop()


def test_a_group_on_the_hosts_goes_back_to_its_node_when_it_answers(start_node: Any, secret_file: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = naca_config([f"127.0.0.1:{port}"], secret_file, join_timeout=0.3, reprobe_after=4)
    with World(2, config=cfg, timeout=120) as world:
        first = world.run(on_hosts)
        node = start_node("--port", str(port))
        results = world.run(allreduces, 12, 100)
    assert all(c["allreduce.naca.fallback.ring"] == 1 for c in first)
    for res in results:
        c = res["counters"]
        assert all(res["right"]) and c["naca.returns"] == 1, c
        # 1 + 3 more on the hosts until the 4th asks the node again, which serves it and the rest
        assert c["allreduce.naca.fallback.ring"] == 4 and c["allreduce.naca.offloaded"] == 9, c
    assert " 0 joins" not in node.stop()


def on_hosts(pg: Any) -> dict[str, int]:
    pg.allreduce(np.ones(100, np.int64))  # no node answers: on the hosts
    return pg.counters()
