"""hivemind as a system of ``erdma bench`` (``--backend hivemind``; ``pip install hivemind``): an allreduce is
one averaging round of ``hivemind.averaging.DecentralizedAverager`` over its own libp2p daemon, in a group of
every rank, matchmaking included as a hivemind user pays it; the mean times the world size is the sum the
benchmark checks. The benchmark's own bookkeeping (max and sum of timings over ranks, and rank 0's DHT
addresses for the others to join) goes through Gloo and is not timed. Every rank listens on ``HIVEMIND_HOST``
(default: its address towards ``MASTER_ADDR``)."""

from __future__ import annotations

import os
import time
from typing import Any

from ..net.addresses import route_source
from .bench_backends import Gloo

MATCHMAKING_S = 1.0  # hivemind's min_matchmaking_time: how long a round may wait to gather its group
REQUEST_S = 0.5  # its request_timeout (it asks for less than the matchmaking time)
ROUND_S = 300.0  # an averaging round that has not ended by then fails the benchmark


class Hivemind(Gloo):
    """Gloo's process group for the bookkeeping (``Gloo``), hivemind's averager for the op."""

    name = "hivemind"

    def __init__(self, algorithm: str | None) -> None:
        import hivemind

        super().__init__(algorithm)
        host = os.environ.get("HIVEMIND_HOST") or route_source(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        listen = [f"/ip4/{host}/tcp/0"]
        first: list[Any] = [None]  # rank 0's DHT addresses, broadcast to the others
        if self.rank == 0:
            self.dht = hivemind.DHT(start=True, host_maddrs=listen)
            first = [[str(a) for a in self.dht.get_visible_maddrs()]]
        self.dist.broadcast_object_list(first, 0)
        if self.rank != 0:
            self.dht = hivemind.DHT(start=True, host_maddrs=listen, initial_peers=first[0])
        self.averagers: dict[tuple[int, Any], Any] = {}

    def _averager(self, like: Any) -> Any:
        key = (like.numel(), like.dtype)
        if key not in self.averagers:
            from hivemind.averaging import DecentralizedAverager

            self.averagers[key] = DecentralizedAverager(
                [self.torch.zeros_like(like)], self.dht, prefix=f"erdma-bench-{key[0]}-{str(key[1])[6:]}",
                target_group_size=self.size, min_group_size=self.size, min_matchmaking_time=MATCHMAKING_S,
                request_timeout=REQUEST_S, start=True)
        return self.averagers[key]

    def op(self, name: str, out: Any, inp: Any) -> None:
        if name != "allreduce":
            raise SystemExit(f"--backend hivemind: --op {name} has no hivemind counterpart; valid: allreduce")
        av = self._averager(out)
        with av.get_tensors() as tensors:
            tensors[0].copy_(out)
        start = time.monotonic()
        if av.step(timeout=ROUND_S) is None:
            raise RuntimeError(f"hivemind: rank {self.rank}'s averaging round found no group of {self.size} within "
                               f"{time.monotonic() - start:.0f}s")
        with av.get_tensors() as tensors:
            out.copy_(tensors[0])
        out.mul_(self.size)

    def close(self) -> None:
        for av in self.averagers.values():
            av.shutdown()
        self.dht.shutdown()
        super().close()
