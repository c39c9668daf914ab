"""``TransportConformance``: the behaviour every transport must show. A transport plugin's tests do

    from erdma_core.testing.conformance import TransportConformance

    class TestQuic(TransportConformance):
        transport = "quic"
        config = {"transport.quic.secret": "test-secret"}

The tests run real worlds through the ``erdma_world`` fixture of ``erdma_core.testing.pytest_plugin``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, ClassVar

import numpy as np

from ..errors import MismatchError, PeerLostError


def _allreduce_all_algorithms(pg: Any) -> list[str]:
    bad = []
    for algo in ("ring", "halving_doubling", "recursive_doubling", "tree", "parameter_server"):
        for n in (0, 1, 1000, 300_001):
            arr = np.arange(n, dtype=np.int64) * (pg.rank() + 1)
            pg.allreduce(arr, algorithm=algo)
            if not np.array_equal(arr, np.arange(n) * (pg.size() * (pg.size() + 1) // 2)):
                bad.append(f"{algo} n={n}")
    return bad


def _big_exchange(pg: Any, nbytes: int) -> bool:
    """Both ranks send ``nbytes`` to each other at the same time, in three tags, out of order."""
    peer = 1 - pg.rank()
    n = nbytes // 3 // 8
    mine = [np.full(n, pg.rank() * 10 + t, np.int64) for t in range(3)]
    got = [np.zeros(n, np.int64) for _ in range(3)]
    recvs = [pg.irecv(got[t], peer, tag=t) for t in (2, 0, 1)]
    sends = [pg.isend(mine[t], peer, tag=t) for t in range(3)]
    for w in sends + recvs:
        w.wait(60)
    return all((got[t] == peer * 10 + t).all() for t in range(3))


def _many_small(pg: Any) -> bool:
    arr = np.zeros(1, np.int32)
    for i in range(300):
        arr[0] = i + pg.rank()
        pg.allreduce(arr)
        if arr[0] != i * pg.size() + sum(range(pg.size())):
            return False
    pg.barrier()
    return True


def _die(pg: Any) -> None:
    arr = np.ones(4 << 20, np.float32)
    if pg.rank() == 0:
        pg.allreduce(arr, async_op=True)
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(2):  # the first may still finish; the dead rank never joins the second
        pg.allreduce(arr)


def _mismatch(pg: Any) -> None:
    pg.allreduce(np.ones(8 + pg.rank(), np.float64))


class TransportConformance:
    transport: ClassVar[str] = "tcp"
    config: ClassVar[dict[str, Any]] = {}
    #: what each rank sends in ``test_large_concurrent_tagged_exchange``; a class whose settings make every
    #: byte cost many round trips (tiny slots or windows) may send less, as long as it still wraps them many times
    exchange_bytes: ClassVar[int] = 24 << 20

    def world_config(self) -> dict[str, Any]:
        return {"transport.name": self.transport, "timeouts.collective": 60.0, **self.config}

    def test_allreduce_every_algorithm(self, erdma_world: Any) -> None:
        assert erdma_world(3, self.world_config()).run(_allreduce_all_algorithms) == [[]] * 3

    def test_large_concurrent_tagged_exchange(self, erdma_world: Any) -> None:
        assert erdma_world(2, self.world_config()).run(_big_exchange, self.exchange_bytes) == [True, True]

    def test_many_small_collectives(self, erdma_world: Any) -> None:
        assert erdma_world(3, self.world_config()).run(_many_small) == [True] * 3

    def test_peer_death_reaches_every_survivor(self, erdma_world: Any) -> None:
        outcomes = erdma_world(3, self.world_config(), timeout=20).outcomes(_die)
        assert "died" in outcomes[0]
        assert all(isinstance(e, PeerLostError) and e.peer == 0 for e in outcomes[1:]), outcomes

    def test_mismatch_reaches_every_rank(self, erdma_world: Any) -> None:
        outcomes = erdma_world(3, self.world_config(), timeout=20).outcomes(_mismatch)
        assert all(isinstance(e, MismatchError) for e in outcomes), outcomes
