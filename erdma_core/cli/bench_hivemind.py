"""hivemind as a system of ``erdma bench`` (``--backend hivemind``; ``pip install hivemind``): an allreduce is
one averaging round of ``hivemind.averaging.DecentralizedAverager`` over its own libp2p daemon, in a group of
every rank, matchmaking included as a hivemind user pays it; the mean times the world size is the sum the
benchmark checks. The benchmark's own bookkeeping (max and sum of timings over ranks) goes through Gloo and is
not timed. Rank 0 starts the DHT the others join; its addresses travel in the file ``HIVEMIND_PEERS_FILE``
(one job's), and every rank listens on ``HIVEMIND_HOST`` (default 127.0.0.1)."""

from __future__ import annotations

import os
import time
from typing import Any

from .bench import _Gloo

MATCHMAKING_S = 1.0  # hivemind's min_matchmaking_time: how long a round may wait to gather its group
REQUEST_S = 0.5  # its request_timeout (it asks for less than the matchmaking time)
ROUND_S = 300.0  # an averaging round that has not ended by then fails the benchmark


class Hivemind(_Gloo):
    """Gloo's process group for the bookkeeping (``_Gloo``), hivemind's averager for the op."""

    name = "hivemind"

    def __init__(self, algorithm: str | None) -> None:
        import hivemind

        super().__init__(algorithm)
        peers = os.environ["HIVEMIND_PEERS_FILE"]
        listen = [f"/ip4/{os.environ.get('HIVEMIND_HOST', '127.0.0.1')}/tcp/0"]
        if self.rank == 0:
            self.dht = hivemind.DHT(start=True, host_maddrs=listen)
            with open(peers + ".tmp", "w") as f:
                f.write("\n".join(str(a) for a in self.dht.get_visible_maddrs()))
            os.rename(peers + ".tmp", peers)
        self.dist.barrier()
        if self.rank != 0:
            with open(peers) as f:
                self.dht = hivemind.DHT(start=True, host_maddrs=listen, initial_peers=f.read().split())
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
