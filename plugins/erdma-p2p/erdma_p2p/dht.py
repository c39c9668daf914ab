"""A Kademlia node (the ``kademlia`` package) on an event loop of its own, wrapped for eRDMA.

Two kinds of node. A **server** (``erdma dht serve``: long-lived, at a reachable address) routes and stores.
A **client** (each rank, often behind a NAT) only asks: its node id carries ``CLIENT_PREFIX``, and servers
never put such a node in their routing tables, so nobody routes through an address that cannot be reached.
Wrapped around the package:

* RPC timeouts are ``rpc_timeout`` (the package waits 5 s for a dead node);
* every request is checked before it is served (known RPC, argument types and sizes); a server stores only
  what is shaped like a record (``records.shape_ok``), at most ``max_records`` of them, oldest dropped first;
* a read asks every one of the k nodes nearest the key and returns all values found, for the caller to pick
  the highest valid version (the package returns the first or most common one, which may be stale).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

from kademlia.crawling import NodeSpiderCrawl
from kademlia.network import Server
from kademlia.node import Node
from kademlia.protocol import KademliaProtocol
from kademlia.storage import ForgetfulStorage

from .records import MAX_RECORD, shape_ok

log = logging.getLogger("erdma.dht")
CLIENT_PREFIX = b"erdma-client"
_RPCS = {"ping": (bytes,), "store": (bytes, bytes, bytes), "find_node": (bytes, bytes), "find_value": (bytes, bytes),
         "stun": ()}
MAX_DATAGRAM = MAX_RECORD + 1024
DEAD_FOR = 30.0  # seconds a node that did not answer is not asked again
for _name in ("rpcudp", "kademlia"):  # their warnings (every unanswered RPC) would go to stderr unasked
    logging.getLogger(_name).addHandler(logging.NullHandler())
    logging.getLogger(_name).propagate = False


class _Storage(ForgetfulStorage):
    """The package's storage, bounded: at most ``limit`` records (the oldest go first)."""

    def __init__(self, limit: int, ttl: float) -> None:
        super().__init__(ttl=ttl)
        self.limit = limit
        self.data: OrderedDict[bytes, Any] = OrderedDict()

    def __setitem__(self, key: bytes, value: Any) -> None:
        super().__setitem__(key, value)
        while len(self.data) > self.limit:
            self.data.popitem(last=False)


class _Protocol(KademliaProtocol):
    rpc_timeout = 1.0
    stores = True  # False on a client: it keeps nothing for others

    def __init__(self, source_node: Node, storage: Any, ksize: int) -> None:
        super().__init__(source_node, storage, ksize)
        self._wait_timeout = self.rpc_timeout
        self._tasks: set[asyncio.Future[None]] = set()
        self._dead: dict[tuple[str, int], float] = {}

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if 22 <= len(data) <= MAX_DATAGRAM:
            task = asyncio.ensure_future(self._guarded(data, addr))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _guarded(self, data: bytes, addr: Any) -> None:
        try:
            await self._solve_datagram(data, addr)
        except Exception as exc:  # a malformed datagram: dropped
            log.debug("dropped a datagram from %s: %s", addr, exc)

    async def _accept_request(self, msg_id: bytes, data: Any, address: Any) -> None:
        if not isinstance(data, list) or len(data) != 2 or data[0] not in _RPCS:
            return
        if _valid(*data, stores=self.stores):
            await super()._accept_request(msg_id, data, address)

    # a node that did not answer is skipped for DEAD_FOR seconds: the live nodes keep naming it in their
    # answers until they notice, and each lookup would otherwise wait the RPC timeout for it again
    async def call_find_node(self, node_to_ask: Node, node_to_find: Node) -> Any:
        return await self._unless_dead(node_to_ask, super().call_find_node(node_to_ask, node_to_find))

    async def call_find_value(self, node_to_ask: Node, node_to_find: Node) -> Any:
        return await self._unless_dead(node_to_ask, super().call_find_value(node_to_ask, node_to_find))

    async def call_store(self, node_to_ask: Node, key: bytes, value: Any) -> Any:
        return await self._unless_dead(node_to_ask, super().call_store(node_to_ask, key, value))

    async def _unless_dead(self, node: Node, call: Coroutine[Any, Any, Any]) -> Any:
        addr = (node.ip, node.port)
        now = asyncio.get_running_loop().time()
        if self._dead.get(addr, 0.0) > now:
            call.close()
            self.router.remove_contact(node)
            return False, None
        result = await call
        if not result[0]:
            self._dead[addr] = now + DEAD_FOR
        else:
            self._dead.pop(addr, None)
        return result

    def welcome_if_new(self, node: Node) -> None:
        if node.id.startswith(CLIENT_PREFIX):
            return  # clients ask; they never route or store for others
        super().welcome_if_new(node)


def _valid(name: str, args: Any, stores: bool) -> bool:
    """Whether a request may be served: its arguments' types, node ids and keys of 20 bytes, and a record
    to store shaped like one (and only on a node that stores)."""
    types = _RPCS[name]
    if not isinstance(args, list) or len(args) != len(types):
        return False
    if not all(isinstance(a, t) for a, t in zip(args, types, strict=True)):
        return False
    if not all(len(a) == 20 for a in (args[:2] if name == "store" else args)):
        return False
    return name != "store" or (stores and shape_ok(args[2]))


class DhtNode:
    """A node on its own thread. ``server``: routes and stores for others; else a client."""

    def __init__(self, *, server: bool, rpc_timeout: float = 1.0, max_records: int = 100_000,
                 ttl: float = 7 * 86400.0, ksize: int = 20) -> None:
        proto = type("_P", (_Protocol,), {"rpc_timeout": rpc_timeout, "stores": server})
        node_id = None if server else CLIENT_PREFIX + os.urandom(20 - len(CLIENT_PREFIX))
        self.server = Server(ksize=ksize, node_id=node_id, storage=_Storage(max_records, ttl))
        self.server.protocol_class = proto
        self.rpc_timeout = rpc_timeout
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="erdma-dht", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run ``coro`` on the node's loop; TimeoutError after ``timeout`` seconds."""
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop)
        try:
            return fut.result(timeout + 1.0)
        except (TimeoutError, cf.TimeoutError):
            fut.cancel()
            raise TimeoutError(f"no answer from the DHT within {timeout:.1f}s") from None

    def start(self, bind: str, port: int, bootstrap: list[tuple[str, int]], timeout: float) -> tuple[str, int]:
        """Listen on ``bind:port`` and join through ``bootstrap``; the address bound. Raises OSError or
        TimeoutError; a client that reaches no bootstrap node raises ConnectionError."""

        async def go() -> tuple[str, int]:
            await self.server.listen(port, bind or "0.0.0.0")
            sockname = self.server.transport.get_extra_info("sockname")
            if bootstrap:
                await self.server.bootstrap(bootstrap)
            return sockname[0], sockname[1]

        addr = self.run(go(), timeout)
        if bootstrap and not self.neighbours():
            raise ConnectionError("no DHT bootstrap node answered: " + ", ".join(f"{h}:{p}" for h, p in bootstrap))
        return addr

    def neighbours(self) -> list[tuple[str, int]]:
        """The nodes in this node's routing table."""

        async def go() -> list[tuple[str, int]]:
            return [(n.ip, n.port) for n in self.server.protocol.router.find_neighbors(self.server.node)]

        return list(self.run(go(), self.rpc_timeout))

    async def _nearest(self, dkey: bytes) -> list[Node]:
        node = Node(dkey)
        near = self.server.protocol.router.find_neighbors(node)
        if not near:
            return []
        return list(await NodeSpiderCrawl(self.server.protocol, node, near, self.server.ksize,
                                          self.server.alpha).find())

    def put(self, dkey: bytes, blob: bytes, timeout: float) -> int:
        """Store ``blob`` under ``dkey`` on the k nearest nodes; how many took it."""

        async def go() -> int:
            nodes = await self._nearest(dkey)
            got = await asyncio.gather(*(self.server.protocol.call_store(n, dkey, blob) for n in nodes))
            return sum(1 for ok, answer in got if ok and answer is True)

        return int(self.run(go(), timeout))

    def fetch(self, dkey: bytes, timeout: float) -> list[bytes]:
        """Every value the k nearest nodes hold for ``dkey``."""

        async def go() -> list[bytes]:
            nodes = await self._nearest(dkey)
            got = await asyncio.gather(*(self.server.protocol.call_find_value(n, Node(dkey)) for n in nodes))
            return [a["value"] for ok, a in got if ok and isinstance(a, dict) and isinstance(a.get("value"), bytes)]

        return list(self.run(go(), timeout))

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.server.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()
