"""Who may run a handshake, and what is said about those refused: sans-IO (times are arguments), shared by
the transports' acceptor and the discovery store (``gate.Gate``).

``Admission`` bounds the connections still in their handshake, in all and per source address, so that an
outsider, who can open connections but cannot finish a handshake, never takes a rank's place. A newcomer
from a source that holds its share already takes the place of one of that source's connections that has
stalled (it owes bytes and has sent none for ``STALL_S``: a rank sends each message of its handshake at
once, an idle or trickling connection does not), or is refused: the newest unauthenticated connection goes
first. When the whole table is full, a newcomer takes the place of the newest connection of the source that
holds the most, if that source holds at least two more than the newcomer's, else of the connection stalled
longest, else it is refused. An outsider's flood or trickle from a few addresses thus fills only its own
shares, and a rank from another address always finds a place; it takes an outsider with ``limit /
per_source`` addresses or more to fill the table.

``Refusals`` turns refusals into log lines: the first for each reason at once, then one summary at most
every ``every`` seconds (a flood of connections is not a flood of lines); ``latest`` keeps the last few
reasons for an error message.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Hashable

HANDSHAKE_S = 5.0  # seconds a connection may take for its whole handshake
STALL_S = 1.0  # seconds a connection may owe bytes before it may be dropped for a newcomer


class _Slot:
    __slots__ = ("opened", "source", "waiting")

    def __init__(self, source: str, now: float) -> None:
        self.source, self.opened, self.waiting = source, now, now


class Admission:
    """``admit(key, source, now)`` -> ``(admitted, dropped)``: whether the new connection ``key`` from
    ``source`` may run its handshake, and the key of a pending one to drop for it (or None). The caller says
    when a pending connection has sent what it owed (``answered``) and when it is gone (``remove``)."""

    def __init__(self, limit: int, per_source: int, stall: float = STALL_S) -> None:
        self.limit, self.per_source, self.stall = limit, per_source, stall
        self._slots: dict[Hashable, _Slot] = {}
        self._by_source: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._slots)

    def admit(self, key: Hashable, source: str, now: float) -> tuple[bool, Hashable | None]:
        mine = self._by_source[source]
        if mine >= self.per_source:
            dropped = self._stalled(now, source)
        elif len(self._slots) >= self.limit:
            busiest = max(self._by_source, key=self._by_source.__getitem__)
            if self._by_source[busiest] >= mine + 2:
                dropped = next(k for k in reversed(self._slots) if self._slots[k].source == busiest)
            else:
                dropped = self._stalled(now, None)
        else:
            dropped = None
            self._add(key, source, now)
            return True, None
        if dropped is None:
            return False, None
        self.remove(dropped)
        self._add(key, source, now)
        return True, dropped

    def _add(self, key: Hashable, source: str, now: float) -> None:
        self._slots[key] = _Slot(source, now)
        self._by_source[source] += 1

    def _stalled(self, now: float, source: str | None) -> Hashable | None:
        """The pending connection (of ``source``, or of any) that has owed bytes longest, past ``stall``."""
        found, since = None, now - self.stall
        for key, slot in self._slots.items():
            if (slot.waiting < since or (found is None and slot.waiting == since)) and \
                    (source is None or slot.source == source):
                found, since = key, slot.waiting
        return found

    def answered(self, key: Hashable, now: float) -> None:
        """``key`` sent a whole message of its handshake (and was answered): its stall clock starts again."""
        slot = self._slots.get(key)
        if slot is not None:
            slot.waiting = now

    def oldest(self) -> Hashable | None:
        """The pending connection opened first, or None."""
        return next(iter(self._slots), None)

    def expired(self, now: float, limit: float = HANDSHAKE_S) -> list[Hashable]:
        """Pending connections opened more than ``limit`` seconds ago."""
        return [key for key, slot in self._slots.items() if now - slot.opened >= limit]

    def deadline(self, limit: float = HANDSHAKE_S) -> float | None:
        """When the oldest pending connection expires, or None when none is pending."""
        if not self._slots:
            return None
        return min(slot.opened for slot in self._slots.values()) + limit

    def remove(self, key: Hashable) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._by_source[slot.source] -= 1
            if not self._by_source[slot.source]:
                del self._by_source[slot.source]


class Refusals:
    """``note(where, why, now)`` records a refused connection and returns a line to log, or None: the first
    refusal for each reason at once (up to ``SAID`` reasons), the others as a summary at most every ``every``
    seconds; ``flush(now)`` returns the summary still owed (at the end)."""

    SAID = 8

    def __init__(self, what: str, every: float = 10.0) -> None:
        self.what, self.every = what, every
        self.latest: deque[str] = deque(maxlen=8)  # the last reasons, "where why", for an error message
        self.total = 0
        self._said: set[str] = set()  # reasons logged at once
        self._since: Counter[str] = Counter()  # reasons since the last line
        self._sources: Counter[str] = Counter()
        self._last = -math.inf

    def note(self, where: str, why: str, now: float) -> str | None:
        self.total += 1
        self.latest.append(f"{where} {why}")
        if why not in self._said and len(self._said) < self.SAID:
            self._said.add(why)
            return f"{self.what}: refused a connection from {where}: {why}"
        self._since[why] += 1
        self._sources[where.rsplit(":", 1)[0]] += 1
        if self._last == -math.inf:
            self._last = now
        return self.flush(now) if now - self._last >= self.every else None

    def flush(self, now: float) -> str | None:
        if not self._since:
            return None
        n = sum(self._since.values())
        why = "; ".join(f"{count}: {reason}" for reason, count in self._since.most_common(3))
        sources = ", ".join(f"{s} ({count})" for s, count in self._sources.most_common(3))
        line = (f"{self.what}: refused {n} more connection(s) in the last {max(0.0, now - self._last):.0f}s ({why}"
                f"{'; ...' if len(self._since) > 3 else ''}; from {sources}{', ...' if len(self._sources) > 3 else ''})")
        self._since.clear()
        self._sources.clear()
        self._last = now
        return line
