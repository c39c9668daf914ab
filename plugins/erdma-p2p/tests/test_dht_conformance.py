"""``dht://`` passes the core's store conformance kit: three ranks' stores, each reaching the DHT through
another of three real DHT nodes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from erdma_p2p import records
from erdma_p2p.dht import DhtNode

from erdma_core.testing.store_conformance import StoreConformance


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[DhtNode]]:
    first = DhtNode(server=True, rpc_timeout=0.5)
    addr = first.start("127.0.0.1", 0, [], 5.0)
    more = [DhtNode(server=True, rpc_timeout=0.5) for _ in range(2)]
    for n in more:
        n.start("127.0.0.1", 0, [addr], 5.0)
    yield [first, *more]
    for n in [first, *more]:
        n.stop()


class TestDhtStore(StoreConformance):
    config: ClassVar[dict[str, Any]] = {"security.secret": "store-conformance", "discovery.dht.bind_address": "127.0.0.1",
              "discovery.dht.rpc_timeout": 0.5, "discovery.dht.poll_max": 0.1}
    wait_s = 15.0
    large_value_bytes = records.MAX_VALUE  # what one record holds: a DHT stores small entries
    atomic_add = False  # each process adds to its own share: the total is exact, two adds may return alike

    @pytest.fixture(autouse=True)
    def _nodes(self, nodes: list[DhtNode]) -> None:
        self.nodes = nodes

    def url(self, tmp_path: Path) -> str:
        host, port = self.nodes[0].server.transport.get_extra_info("sockname")[:2]
        return f"dht://{host}:{port}/conformance-{tmp_path.name}"
