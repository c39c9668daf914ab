"""A Kademlia node (the ``kademlia`` package) on an event loop of its own, wrapped for eRDMA.

Two kinds of node. A **server** (``erdma dht serve``: long-lived, at a reachable address) routes and stores.
A **client** (each rank, often behind a NAT) only asks: its node id carries ``CLIENT_PREFIX``, and servers
never put such a node in their routing tables, so nobody routes through an address that cannot be reached.
Wrapped around the package:

* RPC timeouts are ``rpc_timeout`` (the package waits 5 s for a dead node);
* every request is checked before it is served (known RPC, argument types and sizes); a server stores a
  record only under the key it was signed for and with a valid signature (``records.check``), keeps the
  newest of a key's, and bounds what each sending address holds (``_Storage``);
* a write goes to the k nodes nearest the key and to the bootstrap nodes this node was given, and a read
  asks the same nodes and returns all values found, for the caller to pick the highest valid version (the
  package returns the first or most common one, which may be stale): nodes that take records and keep
  nothing (Sybils near the key) cannot hide a record the bootstrap nodes hold.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from functools import partial
from typing import Any

from kademlia.network import Server
from kademlia.node import Node
from kademlia.protocol import KademliaProtocol

from . import records
from .lookup import Lookup, Rtt
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


class _Storage:
    """What a server node keeps: per DHT key the newest valid record (``records.check``) and the address that
    sent it. An address holds at most ``per_source`` records (its oldest goes for a new one); at ``limit`` in
    all, the oldest record of the address holding the most goes: a flood of valid records (an outsider signs
    records of its own) from a few addresses churns only its own. Records leave ``ttl`` seconds after they
    were stored, or when they expire. The package's storage interface, less republishing
    (``iter_older_than`` yields nothing: writers refresh their records themselves, ``DhtStore.keep``, and a
    counter's readers write back the shares it lost, ``DhtStore.add``)."""

    def __init__(self, limit: int, ttl: float, per_source: int) -> None:
        self.limit, self.ttl, self.per_source = limit, ttl, per_source
        self.data: OrderedDict[bytes, tuple[float, bytes, str, int, float]] = OrderedDict()  # stored, blob, source,
        # version, expires
        self._of: dict[str, OrderedDict[bytes, None]] = {}  # source -> its keys, oldest first

    def put(self, key: bytes, blob: object, source: str) -> bool:
        """Store ``blob`` under ``key`` (sent from ``source``); whether this node now holds it."""
        head = records.check(key, blob)
        if head is None or head.expires <= time.time():
            return False
        assert isinstance(blob, bytes)
        old = self.data.get(key)
        if old is not None:
            if old[3] >= head.version:
                return old[1] == blob
            self._drop(key)
        mine = self._of.setdefault(source, OrderedDict())
        if len(mine) >= self.per_source:
            self._drop(next(iter(mine)))
        if len(self.data) >= self.limit:
            busiest = max(self._of.values(), key=len)
            self._drop(next(iter(busiest)))
        self.data[key] = (time.monotonic(), blob, source, head.version, head.expires)
        self._of.setdefault(source, OrderedDict())[key] = None
        return True

    def _drop(self, key: bytes) -> None:
        _, _, source, _, _ = self.data.pop(key)
        mine = self._of[source]
        del mine[key]
        if not mine:
            del self._of[source]

    def _cull(self) -> None:
        now, wall = time.monotonic(), time.time()
        for key in [k for k, (at, _, _, _, expires) in self.data.items() if now - at > self.ttl or expires <= wall]:
            self._drop(key)

    def get(self, key: bytes, default: Any = None) -> Any:
        self._cull()
        found = self.data.get(key)
        return default if found is None else found[1]

    def __getitem__(self, key: bytes) -> bytes:
        found = self.get(key)
        if found is None:
            raise KeyError(key)
        return found  # type: ignore[no-any-return]

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.put(key, value, "local")

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        self._cull()
        return iter([(k, v[1]) for k, v in self.data.items()])

    def iter_older_than(self, seconds_old: float) -> list[tuple[bytes, bytes]]:
        return []


class _Protocol(KademliaProtocol):
    rpc_timeout = 1.0
    stores = True  # False on a client: it keeps nothing for others

    def __init__(self, source_node: Node, storage: Any, ksize: int) -> None:
        super().__init__(source_node, storage, ksize)
        self._wait_timeout = self.rpc_timeout
        self.tasks: set[asyncio.Future[Any]] = set()
        self._dead: dict[tuple[str, int], float] = {}
        self.rtt = Rtt(self.rpc_timeout)  # over every RPC answered (``lookup``)
        self._open: dict[tuple[str, int], float] = {}  # address -> since when a question to it is unanswered

    def _timeout(self, msg_id: bytes) -> None:
        """rpcudp's (5.x: pinned in pyproject.toml, since this replaces its private method), for a call whose
        caller may have stopped waiting (its ``wait_for`` ran out and cancelled the future): the entry goes
        either way. rpcudp's raised InvalidStateError on the cancelled future and
        kept the entry, one per timed-out call, for the node's life."""
        future, _ = self._outstanding.pop(msg_id, (None, None))
        if future is not None and not future.done():
            future.set_result((False, None))

    def _accept_response(self, msg_id: bytes, data: Any, address: Any) -> None:
        """rpcudp's, for an answer that comes after its caller stopped waiting (as ``_timeout``)."""
        entry = self._outstanding.pop(msg_id, None)
        if entry is None:
            return
        future, timer = entry
        timer.cancel()
        if not future.done():
            future.set_result((True, data))

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if 22 <= len(data) <= MAX_DATAGRAM:
            self.spawn(self._guarded(data, addr))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        """``coro`` as a task kept referenced until it ends (a request served; a question a lookup stopped
        waiting for, which runs on to its RPC timeout)."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

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

    def rpc_store(self, sender: Any, nodeid: bytes, key: bytes, value: Any) -> bool:
        self.welcome_if_new(Node(nodeid, sender[0], sender[1]))
        return bool(self.storage.put(key, value, sender[0]))

    # a node that did not answer is skipped for DEAD_FOR seconds: the live nodes keep naming it in their
    # answers until they notice, and each lookup would otherwise wait the RPC timeout for it again
    async def call_find_node(self, node_to_ask: Node, node_to_find: Node) -> Any:
        return await self._unless_dead(node_to_ask, lambda: super(_Protocol, self).call_find_node(node_to_ask,
                                                                                                  node_to_find))

    async def call_find_value(self, node_to_ask: Node, node_to_find: Node) -> Any:
        return await self._unless_dead(node_to_ask, lambda: super(_Protocol, self).call_find_value(node_to_ask,
                                                                                                   node_to_find))

    async def call_store(self, node_to_ask: Node, key: bytes, value: Any) -> Any:
        return await self._unless_dead(node_to_ask, lambda: super(_Protocol, self).call_store(node_to_ask, key, value))

    async def _unless_dead(self, node: Node, call: Callable[[], Awaitable[Any]]) -> Any:
        result = await self.at((node.ip, node.port), call)
        if not result[0]:
            self.router.remove_contact(node)
        return result

    def forgive(self, addrs: list[tuple[str, int]]) -> None:
        """Ask ``addrs`` again from now on, though they did not answer lately."""
        for addr in addrs:
            self._dead.pop(addr, None)

    async def at(self, addr: tuple[str, int], call: Callable[[], Awaitable[Any]]) -> Any:
        """``call()`` (an RPC to ``addr``), unless ``addr`` did not answer lately: then ``(False, None)``."""
        now = asyncio.get_running_loop().time()
        if self._dead.get(addr, 0.0) > now:
            return False, None
        self._open.setdefault(addr, now)
        try:
            result = await call()
        finally:
            self._open.pop(addr, None)
        if not result[0]:
            self._dead[addr] = now + DEAD_FOR
        else:
            self.rtt.sample(asyncio.get_running_loop().time() - now)
            self._dead.pop(addr, None)
        return result

    def silent(self, addr: tuple[str, int], now: float, grace: float) -> bool:
        """Whether a question to ``addr`` has been unanswered for ``grace`` already (another lookup's): a lookup
        does not wait for it again."""
        return now - self._open.get(addr, now) >= grace

    def welcome_if_new(self, node: Node) -> None:
        if node.id.startswith(CLIENT_PREFIX):
            return  # clients ask; they never route or store for others
        super().welcome_if_new(node)


def _contact(t: Any) -> bool:
    """Whether ``t`` in a find_node answer is a contact: (id of 20 bytes, host, port)."""
    return (isinstance(t, (list, tuple)) and len(t) == 3 and isinstance(t[0], bytes) and len(t[0]) == 20
            and isinstance(t[1], str) and isinstance(t[2], int))


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
                 ttl: float = 7 * 86400.0, ksize: int = 20, per_source: int = 10_000) -> None:
        proto = type("_P", (_Protocol,), {"rpc_timeout": rpc_timeout, "stores": server})
        node_id = None if server else CLIENT_PREFIX + os.urandom(20 - len(CLIENT_PREFIX))
        self.server = Server(ksize=ksize, node_id=node_id, storage=_Storage(max_records, ttl, per_source))
        self.server.protocol_class = proto
        self.rpc_timeout = rpc_timeout
        self.bootstrap: list[tuple[str, int]] = []  # asked on every read and write besides the nearest
        self._seen: dict[tuple[str, int], None] = {}  # server nodes met so far (oldest first, at most ksize * 8)
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
                await self._bootstrap(bootstrap)
            return sockname[0], sockname[1]

        addr = self.run(go(), timeout)
        self.bootstrap = list(bootstrap)
        if bootstrap and not self.neighbours():
            raise ConnectionError("no DHT bootstrap node answered: " + ", ".join(f"{h}:{p}" for h, p in bootstrap))
        return addr

    def known(self) -> list[tuple[str, int]]:
        """The server nodes this node has met (its routing table's and those it asks again when that empties)."""
        try:
            table = self.neighbours()
        except TimeoutError:
            table = []
        return list(dict.fromkeys([*table, *self._seen]))

    def neighbours(self) -> list[tuple[str, int]]:
        """The nodes in this node's routing table."""

        async def go() -> list[tuple[str, int]]:
            return [(n.ip, n.port) for n in self.server.protocol.router.find_neighbors(self.server.node)]

        return list(self.run(go(), self.rpc_timeout))

    async def _nearest(self, dkey: bytes) -> list[Node]:
        """The k nodes nearest ``dkey`` that answered. When none did (every node this one knew missed an answer
        lately, as happens on a busy host, or left), it asks the server nodes it has met again, dead or not,
        before it gives up: once the bootstrap nodes are gone, the job's serving ranks find each other that way."""
        node = Node(dkey)
        found = await self._crawl(node)
        if not found and self._seen:
            self.server.protocol.forgive(list(self._seen))
            await self._bootstrap(list(self._seen))
            found = await self._crawl(node)
        for n in found:
            self._seen[(n.ip, n.port)] = None
        while len(self._seen) > 8 * self.server.ksize:
            del self._seen[next(iter(self._seen))]
        return found

    async def _crawl(self, node: Node) -> list[Node]:
        near = self.server.protocol.router.find_neighbors(node)
        for n in near:
            self._seen[(n.ip, n.port)] = None
        if not near:
            return []
        proto = self.server.protocol
        look = Lookup(node.long_id, near, self.server.ksize, self.server.alpha, proto.rtt.grace(self.rpc_timeout))
        loop = asyncio.get_running_loop()
        open_: dict[asyncio.Future[Any], Node] = {}
        while True:
            now = loop.time()
            for n in look.to_ask(now):
                if proto.silent((n.ip, n.port), now, look.grace):
                    look.unwaited(n)
                else:
                    open_[proto.spawn(proto.call_find_node(n, node))] = n
            wake = look.wake(now)
            if look.done(now) or wake is None:
                log.debug("lookup of %s: %s", node.id.hex()[:8], look.summary(now))
                return look.nearest()  # questions still open run on to their timeout, unwaited
            done, _ = await asyncio.wait(open_, timeout=max(0.0, wake - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                asked = open_.pop(fut)
                ok, answer = fut.result()
                if ok and isinstance(answer, list):
                    look.answered(asked, [Node(*t) for t in answer if _contact(t)])
                else:
                    look.failed(asked)

    async def _bootstrap(self, addrs: list[tuple[str, int]]) -> None:
        """Join through ``addrs``: ask each, and look up this node's id among those that answered (which fills
        the routing table). Once one answered, the others are waited for only ``Rtt.grace`` more (a bootstrap
        node that is down costs no RPC timeout when another is up)."""
        proto, me = self.server.protocol, self.server.node.id
        got = await self._answers({a: partial(proto.ping, a, me) for a in addrs})
        found = [Node(answer, *a) for a, answer in got.items() if isinstance(answer, bytes) and len(answer) == 20]
        for n in found:
            proto.welcome_if_new(n)
        if found:
            await self._crawl(self.server.node)

    async def _answers(self, calls: dict[tuple[str, int], Callable[[], Awaitable[Any]]]) -> dict[tuple[str, int], Any]:
        """Each address's answer to its call, for the calls answered: all of them, or those answered by
        ``Rtt.grace`` after the first answer (the others run on to their RPC timeout, unwaited: a node that is
        down costs no RPC timeout when others are up)."""
        proto, loop = self.server.protocol, asyncio.get_running_loop()
        asks = {proto.spawn(proto.at(a, call)): a for a, call in calls.items()}
        got: dict[tuple[str, int], Any] = {}
        pending, until = set(asks), None
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED,
                                               timeout=None if until is None else max(0.0, until - loop.time()))
            if not done:
                break
            for fut in done:
                ok, answer = fut.result()
                if ok:
                    got[asks[fut]] = answer
            if got and until is None:
                until = loop.time() + proto.rtt.grace(self.rpc_timeout)
        return got

    def _asked(self, nodes: list[Node]) -> list[tuple[str, int]]:
        """The addresses a read or write goes to: ``nodes`` (the nearest) and the bootstrap nodes."""
        return list(dict.fromkeys([(n.ip, n.port) for n in nodes] + self.bootstrap))

    def put(self, dkey: bytes, blob: bytes, timeout: float) -> int:
        """Store ``blob`` under ``dkey`` on the k nearest nodes and the bootstrap nodes, and on this node when
        it serves (a serving rank holds what it writes, for the others and for itself, also when it is the last
        node left); how many took it."""

        async def go() -> int:
            me, proto = self.server.node.id, self.server.protocol
            asked = self._asked(await self._nearest(dkey))
            got = await self._answers({a: partial(proto.store, a, me, dkey, blob) for a in asked})
            here = proto.stores and self.server.storage.put(dkey, blob, "local")
            return sum(1 for answer in got.values() if answer is True) + int(bool(here))

        return int(self.run(go(), timeout))

    def fetch(self, dkey: bytes, timeout: float) -> list[bytes]:
        """Every value the k nearest nodes and the bootstrap nodes hold for ``dkey`` (and this node, serving)."""

        async def go() -> list[bytes]:
            me, proto = self.server.node.id, self.server.protocol
            asked = self._asked(await self._nearest(dkey))
            t0 = asyncio.get_running_loop().time()
            got = await self._answers({a: partial(proto.find_value, a, me, dkey) for a in asked})
            log.debug("fetch of %s: %d of %d answered in %.3fs", dkey.hex()[:8], len(got), len(asked),
                      asyncio.get_running_loop().time() - t0)
            here = self.server.storage.get(dkey) if proto.stores else None
            return [a["value"] for a in got.values() if isinstance(a, dict) and isinstance(a.get("value"), bytes)] \
                + ([here] if isinstance(here, bytes) else [])

        return list(self.run(go(), timeout))

    def stop(self) -> None:
        if self.loop.is_closed():
            return

        async def end() -> None:  # questions still open (a lookup's unwaited ones) are called off
            self.server.stop()
            tasks = list(self.server.protocol.tasks) if self.server.protocol is not None else []
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            try:
                self.run(end(), self.rpc_timeout)
            except TimeoutError:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()
