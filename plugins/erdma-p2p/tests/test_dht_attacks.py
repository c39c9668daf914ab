"""A ``dht://`` job starts although other DHT participants work against it, through two honest ``erdma dht
serve`` nodes: one that answers every read with a forged record and writes forged records under every key it
sees, 50 Sybil nodes that take every record and keep nothing, and a flood of validly signed records of
another job from one address."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from erdma_p2p import records
from erdma_p2p.dht import DhtNode
from erdma_p2p.dht_store import DhtStore
from test_dht import SECTION, _free_udp_port, _job, _serve

FORGED = records.JobKeys(b"not the job's secret", "evil").seal("x", b"10.6.6.6:666", 2**62, time.time() + 86400)


def _node(bootstrap: list[tuple[str, int]], methods: dict[str, Any], bind: str = "127.0.0.2") -> DhtNode:
    """A server node whose protocol has ``methods`` instead of the honest ones, joined to the DHT."""
    node = DhtNode(server=True, rpc_timeout=0.5)
    node.server.protocol_class = type("_Evil", (node.server.protocol_class,), methods)
    node.start(bind, 0, bootstrap, 5.0)
    return node


def _keep_nothing(self: Any, sender: Any, nodeid: bytes, key: bytes, value: Any) -> bool:
    return True  # taken, and dropped


def _never_a_value(self: Any, sender: Any, nodeid: bytes, key: bytes) -> Any:
    return self.rpc_find_node(sender, nodeid, key)


def sybils(bootstrap: list[tuple[str, int]], n: int) -> list[DhtNode]:
    """``n`` Sybil nodes that take every record and keep nothing (the caller stops them)."""
    return [_node(bootstrap, {"rpc_store": _keep_nothing, "rpc_find_value": _never_a_value}) for _ in range(n)]


@contextlib.contextmanager
def forgers(bootstrap: list[tuple[str, int]], n: int, pause: float = 0.02) -> Iterator[set[bytes]]:
    """``n`` nodes that answer every read with a forged record and overwrite every key they see, everywhere,
    again and again (every ``pause`` seconds), until the block ends; yields the keys they saw."""
    seen: set[bytes] = set()

    def store(self: Any, sender: Any, nodeid: bytes, key: bytes, value: Any) -> bool:
        seen.add(key)
        return True

    def find_value(self: Any, sender: Any, nodeid: bytes, key: bytes) -> Any:
        seen.add(key)
        return {"value": FORGED}

    nodes = [_node(bootstrap, {"rpc_store": store, "rpc_find_value": find_value}) for _ in range(n)]
    stop = threading.Event()

    def overwrite() -> None:
        while not stop.is_set():
            for key in list(seen):
                for node in nodes:
                    try:
                        node.put(key, FORGED, 2.0)
                    except TimeoutError:
                        pass
            stop.wait(pause)

    writer = threading.Thread(target=overwrite, daemon=True)
    writer.start()
    try:
        yield seen
    finally:
        stop.set()
        writer.join(30)
        for node in nodes:
            node.stop()


def test_a_node_that_forges_every_record_cannot_stop_the_job(honest: Any, tmp_path: Path) -> None:
    url, addrs = honest
    with forgers(addrs, 1) as seen:
        assert _job(f"{url}/forged", 2, tmp_path) == ["ok 0", "ok 1"]
    assert seen  # it did see the job's keys


def test_fifty_sybil_nodes_that_keep_nothing_cannot_stop_the_job(honest: Any, tmp_path: Path) -> None:
    url, addrs = honest
    nodes = sybils(addrs, 50)
    try:
        start = time.monotonic()
        assert _job(f"{url}/sybils", 2, tmp_path) == ["ok 0", "ok 1"]
        assert time.monotonic() - start < 60
    finally:
        for node in nodes:
            node.stop()


def test_a_flood_of_signed_records_from_one_address_cannot_push_the_jobs_out(tmp_path: Path) -> None:
    port = _free_udp_port()
    server = _serve(port, extra=["--max-records", "50", "--per-source", "20"])
    flooder = DhtNode(server=False, rpc_timeout=0.5)
    flooder.start("127.0.0.2", 0, [("127.0.0.1", port)], 5.0)
    keys = records.JobKeys(b"the flooder's own secret", "flood")
    stop, under_way = threading.Event(), threading.Event()
    stored = [0]

    def flood() -> None:
        i = 0
        while not stop.is_set():
            name = f"junk/{i}"
            try:
                stored[0] += flooder.put(keys.dht_key(name), keys.seal(name, b"x" * 200, 1, time.time() + 3600), 2.0)
            except TimeoutError:
                pass
            i += 1
            if stored[0] >= 100:
                under_way.set()  # twice what the node holds in all: it is churning records now

    flooding = threading.Thread(target=flood, daemon=True)
    flooding.start()
    def after_rank_0() -> None:
        """Rank 1 starts once rank 0's entry is in the DHT and the flood has stored four times what the node
        holds in all since (ranks of a job do not all start at once)."""
        observer = DhtStore([("127.0.0.1", port)], "flooded", b"dht-test", timeout=5.0, section=SECTION)
        try:
            observer.get("erdma/job", 30.0)
        finally:
            observer.close()
        mark, deadline = stored[0], time.monotonic() + 60
        while stored[0] < mark + 200:
            assert time.monotonic() < deadline, f"the flood stored {stored[0] - mark} records in 60 s"
            time.sleep(0.05)

    try:
        assert under_way.wait(60), f"the flood stored {stored[0]} records"
        assert _job(f"dht://127.0.0.1:{port}/flooded", 2, tmp_path, after_first=after_rank_0) == ["ok 0", "ok 1"]
    finally:
        stop.set()
        flooding.join(10)
        flooder.stop()
        server.terminate()
        server.wait(10)
