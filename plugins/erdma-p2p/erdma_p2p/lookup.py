"""An iterative Kademlia lookup that does not wait for nodes slow to answer, and the round-trip estimate that says
how long "slow" is. Both are state machines: time is an argument, and what to send is returned as data.

The ``kademlia`` package's crawl asks ``alpha`` nodes a round and waits for every one of them, so each dead node
in a round costs the whole RPC timeout; nodes go on naming a dead node until they ask it themselves, which a
DHT server seldom does. In a job whose peers serve the DHT, each killed peer then cost every later newcomer
one RPC timeout per lookup round until it learned the node was dead: 2 s of a join's 4 s on this machine.

``Lookup`` keeps up to ``alpha`` questions in flight, as the package does, but a question unanswered after
``grace`` (``Rtt.grace``: three times the median round trip, at least ``GRACE_MIN``) stops
counting towards ``alpha``, and the lookup ends once no question younger than ``grace`` is open and every one of
the ``k`` nearest candidates not known to have failed was asked. A late answer that comes before the end is
used; one that comes after is not waited for (its RPC still runs to its own timeout, which marks a dead node).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from kademlia.node import Node

GRACE_MIN = 0.15  # seconds: the least a question is waited for before the lookup goes on without it


class Rtt:
    """How long answers took: the median of the last ``SAMPLES`` round trips. A median, not TCP's smoothed mean
    and deviation: a node's first answers come while its process starts (imports, other ranks' set-ups on the
    same cores), and one such outlier would hold a mean's deviation up for many samples."""

    SAMPLES = 16
    FACTOR = 3.0  # grace = FACTOR x the median round trip

    def __init__(self, first_grace: float) -> None:
        self.first_grace = first_grace  # before any sample: how long a question is waited for
        self._samples: deque[float] = deque(maxlen=self.SAMPLES)

    def sample(self, seconds: float) -> None:
        self._samples.append(seconds)

    def grace(self, cap: float) -> float:
        """How long to wait for an answer before going on without it: at least ``GRACE_MIN``, at most ``cap``
        (the RPC timeout)."""
        if not self._samples:
            return min(cap, self.first_grace)
        return min(cap, max(GRACE_MIN, self.FACTOR * statistics.median(self._samples)))


@dataclass
class _Candidate:
    node: Node
    asked: float | None = None  # when it was asked
    answered: bool = False
    failed: bool = False


class Lookup:
    """The ``k`` nodes nearest ``target`` (a node id as an int), starting from ``start``."""

    def __init__(self, target: int, start: list[Node], k: int, alpha: int, grace: float) -> None:
        self.target, self.k, self.alpha, self.grace = target, k, alpha, grace
        self.started: float | None = None
        self._by_id: dict[bytes, _Candidate] = {}
        self.add(start)

    def add(self, nodes: list[Node]) -> None:
        for node in nodes:
            if node.id not in self._by_id and node.long_id != self.target:
                self._by_id[node.id] = _Candidate(node)

    def _closest(self) -> list[_Candidate]:
        """The ``k`` nearest candidates not known to have failed."""
        alive = [c for c in self._by_id.values() if not c.failed]
        return sorted(alive, key=lambda c: c.node.long_id ^ self.target)[:self.k]

    def _fresh(self, now: float) -> list[_Candidate]:
        """Questions open for less than ``grace``."""
        return [c for c in self._by_id.values()
                if c.asked is not None and not c.answered and not c.failed and now - c.asked < self.grace]

    def to_ask(self, now: float) -> list[Node]:
        """The nodes to ask now (marked asked at ``now``)."""
        if self.started is None:
            self.started = now
        room = self.alpha - len(self._fresh(now))
        out = []
        for c in self._closest():
            if room <= 0:
                break
            if c.asked is None:
                c.asked = now
                out.append(c.node)
                room -= 1
        return out

    def unwaited(self, node: Node) -> None:
        """``node`` is not waited for (it has left another question unanswered for ``grace`` already): it counts
        as asked long ago."""
        c = self._by_id.get(node.id)
        if c is not None:
            c.asked = float("-inf")

    def answered(self, node: Node, contacts: list[Node]) -> None:
        c = self._by_id.get(node.id)
        if c is not None:
            c.answered = True
        self.add(contacts)

    def failed(self, node: Node) -> None:
        c = self._by_id.get(node.id)
        if c is not None:
            c.failed = True

    def done(self, now: float) -> bool:
        return not self._fresh(now) and all(c.asked is not None for c in self._closest())

    def wake(self, now: float) -> float | None:
        """When the oldest fresh question turns late (None: none is open)."""
        fresh = self._fresh(now)
        return min(c.asked for c in fresh if c.asked is not None) + self.grace if fresh else None

    def nearest(self) -> list[Node]:
        """The ``k`` nearest nodes that answered."""
        answered = [c for c in self._by_id.values() if c.answered]
        return [c.node for c in sorted(answered, key=lambda c: c.node.long_id ^ self.target)[:self.k]]

    def summary(self, now: float) -> str:
        """For the debug log: how long it took, and how many nodes answered, failed, were late."""
        cs = self._by_id.values()
        asked = [c for c in cs if c.asked is not None]
        return (f"{now - (self.started or now):.3f}s, grace {self.grace:.3f}s, {len(cs)} known, {len(asked)} asked, "
                f"{sum(c.answered for c in cs)} answered, {sum(c.failed for c in cs)} failed, "
                f"{sum(not c.answered and not c.failed for c in asked)} late")
