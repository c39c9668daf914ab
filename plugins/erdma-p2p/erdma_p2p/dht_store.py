"""``init_method = "dht://HOST:PORT[,HOST:PORT...]/JOB"``: the job's store is a Kademlia DHT, reached through
the bootstrap nodes named (``erdma dht serve``), with no rank serving anything and no master.

Every rank runs a client node (``dht.DhtNode``; a server node with ``serve``: it then routes and stores for
the others, so the job's records outlive its bootstrap nodes) and keeps its keys in the DHT as records signed and
encrypted with keys derived from ``security.secret`` and the job name (``records.JobKeys``): DHT nodes store
only records signed for the key they are stored under, readers ignore records of other jobs and expired
ones, and of several copies the highest version wins.
``get`` polls until the key appears (backing off to ``poll_max`` seconds); a key this process wrote reads as
its own write when the DHT has none (its nodes left or restarted since). ``add`` reads, adds and writes a
newer version holding each process's share; a counter is a grow-only count of shares, so each process
remembers every share it has seen on it (``MAX_COUNTERS`` keys) and writes back those the DHT lost (a racing
write dropped one, or the nodes that held the record went): a counter never goes back while one process that
read it runs. ``keep(key)``: the key's value is written again every ``KEEP_S`` while the store is open, as
Kademlia's publishers republish (a DHT forgets what its nodes held when they leave: a long-lived peer's
address would be gone after enough churn).
At ``close`` a rank deletes (tombstones) the keys it wrote, so that a later run under the same job name does
not read them; records of a run that crashed expire after ``ttl`` seconds. Use a new job name per run.

A process started with no rank claims one (``assign``): from rank 0 up, it skips ranks whose claim record
exists, writes its own claim (a random token) for the first free one, and reads it back twice, ``settle``
seconds apart (time for racing claims to land): the highest version wins, and a claimant keeps the rank only
if both reads show its token; the others go on to the next. This is not a consensus protocol: two claims
racing past the settle time could both win; the core's duplicate-rank check (``add``, whose shares come back
after a racing write) is what catches such a pair.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

from erdma_core.sdk import CollectiveTimeoutError, ConfigError, ErdmaError
from erdma_core.toolkit import FAILED_PREFIX

from . import records
from .checks import bootstrap_nodes, require_secret
from .dht import DhtNode

WRITE_TRIES = 3  # rounds of store RPCs a write gets before it fails
ADD_TRIES = 8  # read-merge-writes an add makes when racing writers' newer versions refuse its own
MAX_COUNTERS = 1024  # counters whose shares a process remembers (the least recently added to goes)
KEEP_S = 10.0  # how often a kept key is written again


def parse_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """``(bootstrap addresses, job name)`` of a ``dht://`` URL, the hosts resolved; ConfigError naming the key
    otherwise."""
    given, job = bootstrap_nodes(url)
    nodes = []
    for host, port in given:
        try:
            nodes.append((socket.gethostbyname(host), port))
        except OSError as exc:
            raise ConfigError(f"config key 'discovery.init_method': bootstrap host {host!r} does not resolve: "
                              f"{exc}") from None
    return nodes, job


class DhtStore:
    def __init__(self, bootstrap: list[tuple[str, int]], job: str, secret: bytes, *, timeout: float,
                 section: dict[str, Any]) -> None:
        self.job, self.ttl, self.poll_max = job, float(section["ttl"]), float(section["poll_max"])
        self.rpc_timeout = float(section["rpc_timeout"])
        self._keys = records.JobKeys(secret, job)
        self._mine: dict[str, tuple[int, bytes]] = {}  # keys this rank wrote: their version and value
        self.rank: int | None = None  # this process's rank, given or claimed
        self._token = os.urandom(8).hex()  # names this process's shares of add() counters
        self._added: dict[str, int] = {}  # what this process added to each counter
        self._counts: OrderedDict[str, dict[str, int]] = OrderedDict()  # every share seen on each counter
        self._kept: set[str] = set()
        self._keeper: threading.Thread | None = None
        self._closing = threading.Event()
        serve = bool(section.get("serve", False))  # a serving rank holds the job's records beside the bootstrap nodes
        self.node = DhtNode(server=serve, rpc_timeout=self.rpc_timeout, ttl=self.ttl,
                            max_records=int(section.get("max_records", 4096)),
                            per_source=int(section.get("per_source", 512)))
        try:
            self.node.start(section["bind_address"], section["port"], bootstrap, timeout)
        except (OSError, TimeoutError) as exc:
            self.node.stop()
            nodes = ", ".join(f"{h}:{p}" for h, p in bootstrap)
            raise ErdmaError(f"discovery: could not join the DHT through {nodes}: {exc}") from None

    @property
    def budget(self) -> float:
        """Seconds one DHT read or write may take: a lookup's rounds, each bounded by the RPC timeout."""
        return 4 * self.rpc_timeout + 1.0

    def _write(self, key: str, value: bytes, deleted: bool = False, after: int = 0) -> int:
        """Store ``key`` on the DHT, as a version above ``after`` (one read: another host's clock may be
        ahead); a write no node acknowledged is made again (``WRITE_TRIES`` in all: on a busy host one round
        of RPCs can all time out) before it fails."""
        version = max(time.time_ns(), self._mine.get(key, (0, b""))[0] + 1, after + 1)
        blob = self._keys.seal(key, value, version, time.time() + self.ttl, deleted)
        took = 0
        for _ in range(WRITE_TRIES):
            try:
                took = self.node.put(self._keys.dht_key(key), blob, self.budget)
            except TimeoutError:
                took = 0
            if took:
                break
        if not took:
            known = ", ".join(f"{h}:{p}" for h, p in self.node.known()) or "none"
            raise ErdmaError(f"discovery: no DHT node stored key {key!r} of job {self.job!r} in {WRITE_TRIES} "
                             f"tries (are the bootstrap nodes up? nodes this one knows: {known})")
        self._mine[key] = (version, value)
        return version

    def _read(self, key: str) -> records.Record | None:
        try:
            blobs: list[object] = list(self.node.fetch(self._keys.dht_key(key), self.budget))
        except TimeoutError:
            return None
        return self._keys.latest(key, blobs, time.time())

    def assign(self, world_size: int, timeout: float, settle: float = 0.3) -> int:
        """Claim the lowest free rank of ``world_size`` (see the module's text); ErdmaError when all are
        taken, CollectiveTimeoutError past ``timeout``."""
        token = os.urandom(16).hex().encode()
        deadline = time.monotonic() + timeout
        for rank in range(world_size):
            key = f"erdma/rank/{rank}"
            found = self._read(key)
            if found is not None and not found.deleted:
                continue  # claimed by another process
            try:
                self._write(key, token)
            except ErdmaError:
                found = self._read(key)
                if found is None or found.deleted or found.value == token:
                    raise
                continue  # the nodes hold another process's newer claim and refuse this one: it lost the race
            if all(self._held(key, token, settle) for _ in range(2)):
                return rank
            self._mine.pop(key, None)  # lost the race: the winner's claim stays
            if time.monotonic() > deadline:
                break
        else:
            raise ErdmaError(f"discovery: all {world_size} ranks of job {self.job!r} are claimed (world_size "
                             f"{world_size}; is this process one too many, or the job name in use?)")
        raise CollectiveTimeoutError(f"discovery: no rank of job {self.job!r} claimed within {timeout:.1f}s")

    def _held(self, key: str, token: bytes, settle: float) -> bool:
        time.sleep(settle)
        found = self._read(key)
        return found is not None and found.value == token

    def set(self, key: str, value: bytes) -> None:
        """Write ``key``. A write the nodes refuse because another process wrote the key with a newer version
        meanwhile (two peers saying the same, such as that the job finished) lost a race it may lose: the
        newer value stands, as if this one had been written first."""
        try:
            self._write(key, value)
        except ErdmaError:
            found = self._read(key)
            if found is None or (found.value == value and found.version == self._mine.get(key, (0, b""))[0]):
                raise
            self._mine[key] = (found.version, found.value)  # (deleted at close like a key of its own)

    def get(self, key: str, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        wait = 0.02
        while True:
            found = self._read(key)
            if found is not None and not found.deleted:
                return found.value
            if found is None and key in self._mine and self._mine[key][1]:  # the DHT lost what this process
                return self._mine[key][1]  # wrote (a write that lost a race holds the winner's value here)
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeoutError(f"discovery: key {key!r} did not appear in the DHT (job {self.job!r}) "
                                             f"within {timeout:.1f}s (are all ranks started with the same "
                                             "init_method, job name and world size?)")
            time.sleep(min(wait, left))
            wait = min(wait * 2, self.poll_max)

    def add(self, key: str, amount: int) -> int:
        """The counter after adding ``amount``. The record holds each process's share (``token=n`` pairs), so
        a share that a racing write overwrote comes back with this process's next ``add`` on the key (an
        ``add`` of 0 re-asserts it): two processes that both added 1 then both count 2 once each has added
        again, which is how the core's duplicate-rank check sees a rank claimed twice. A write the nodes
        refuse because another process wrote a newer version meanwhile is merged with that version and made
        again, and a write they took is read back: a racing write of the same version that some nodes took
        instead drops this share, which is then merged in and written again (``ADD_TRIES`` in all). Without the
        read back, a share lost so came back only when its process added again: a set-up's rank 0 waited out
        its wait for the share of a rank that had added once."""
        mine = self._added.get(key, 0) + amount
        if mine:
            self._added[key] = mine
        known = self._counts.pop(key, {})
        self._counts[key] = known  # (the most recently added to last)
        while len(self._counts) > MAX_COUNTERS:
            self._counts.popitem(last=False)
        if mine:
            known[self._token] = mine
        for attempt in range(ADD_TRIES):
            found = self._read(key)
            shares = _shares(found.value) if found is not None and not found.deleted else {}
            for token, n in shares.items():
                known[token] = max(known.get(token, 0), n)
            if all(shares.get(token, 0) >= n for token, n in known.items()):
                return sum(shares.values())
            try:  # this share, or shares seen before that the DHT lost
                self._write(key, ",".join(f"{t}={n}" for t, n in sorted(known.items())).encode(),
                            after=found.version if found is not None else 0)
                continue  # read back (the next attempt returns once this share is there)
            except ErdmaError:
                newer = self._read(key)
                if newer is None or (found is not None and newer.version <= found.version):
                    raise  # not a lost race: no node took it and none holds anything newer
            time.sleep(random.uniform(0.0, 0.02 * (attempt + 1)))  # racing writers spread out
        raise ErdmaError(f"discovery: counter {key!r} of job {self.job!r} was overwritten by racing writes "
                         f"{ADD_TRIES} times in a row")

    def keep(self, key: str) -> None:
        """Write ``key``, which this process wrote and only it writes (a peer's address), again every
        ``KEEP_S`` seconds while the store is open, on a thread of the store's."""
        self._kept.add(key)
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name="erdma-dht-keep", daemon=True)
            self._keeper.start()

    def unkeep(self, key: str) -> None:
        """Stop writing ``key`` again (another process writes it now: an elastic job's ``epoch/latest`` once
        this peer is no longer the record's member 0). What the DHT holds stays until it expires."""
        self._kept.discard(key)

    def _keep(self) -> None:
        while not self._closing.wait(KEEP_S):
            for key in list(self._kept):
                got = self._mine.get(key)
                if got is None or self._closing.is_set():
                    continue
                try:
                    self._write(key, got[1])
                except ErdmaError:  # no node answered this time: again at the next round
                    pass

    def _stop_keeping(self) -> None:
        self._closing.set()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(self.budget * WRITE_TRIES + 1.0)

    def detach(self) -> None:
        """Leave the DHT, keeping the keys this rank wrote (they expire after ``ttl``): for an elastic job's
        records, which the job goes on reading after this peer (or its creator) is gone."""
        self._stop_keeping()
        self._mine.clear()
        self.node.stop()

    def close(self) -> None:
        self._stop_keeping()
        for key in [k for k in self._mine if not k.startswith(FAILED_PREFIX)]:  # (why this rank gave up: kept)
            try:
                self._write(key, b"", deleted=True)
            except ErdmaError:  # best effort: the records expire anyway
                break
        self._mine.clear()
        self.node.stop()


def _shares(value: bytes) -> dict[str, int]:
    """``token=n,token=n`` (what ``add`` writes) as a dict; anything malformed counts as nothing."""
    out = {}
    for item in value.decode(errors="replace").split(","):
        token, sep, n = item.partition("=")
        if sep and n.isdigit():
            out[token] = int(n)
    return out


def dht_store(url: str, rank: int | None, world_size: int, timeout: float, config: Any) -> DhtStore:
    require_secret(config)  # (as load_config's check did: a store made from a config built otherwise)
    bootstrap, job = parse_url(url)
    secret = config["security.secret"].encode()
    store = DhtStore(bootstrap, job, secret, timeout=timeout, section=config.section("discovery.dht"))
    try:
        store.rank = rank if rank is not None else store.assign(world_size, timeout)
    except BaseException:
        store.close()
        raise
    return store

