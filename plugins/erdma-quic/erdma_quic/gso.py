"""Which paths take UDP GSO messages, proven per path by a probe the peer's port answers.

A GSO message is one buffer the kernel cuts into datagrams of a given size. Where that works, a run of
full-size QUIC packets costs one ``sendmsg``. Where it does not, nothing says so: a NAT in the sending host's
own stack (nftables SNAT on a veth without checksum offload, seen in the lab) forwards the cut datagrams with
wrong UDP checksums, and the peer's kernel drops them silently. QUIC then loses every full-size run, its window
collapses, and the transfer stalls.

So a port sends a path its first GSO message only as a probe: ``SEGMENTS`` datagrams of the run's size, each
``PROBE`` + an 8-byte nonce + its index. The peer's port answers each with a short ``ANSWER`` + nonce + index
(no state, no allocation, a sixtieth of what it answers at most, rate-limited). Once every index came back,
the path takes GSO; a path that answered none of ``TRIES`` probes whole sends datagrams one by one, and is
tried again after ``RETRY``. A proven path is proven again every ``RECHECK`` seconds while it keeps GSO (a
NAT on the way may change). Neither message can be a QUIC packet (first byte 0: the fixed bit is clear) or
STUN (no magic cookie). Sans-IO: time is an argument, what to send is returned.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PROBE = b"\x00erdma-gso?"
ANSWER = b"\x00erdma-gso!"
NONCE = 8
SEGMENTS = 2
TRIES = 3  # probes per round
SPACING = 0.5  # seconds between the probes of a round
RECHECK = 10.0  # seconds a proven path keeps GSO before it is probed again
RETRY = 60.0  # seconds a path that failed sends one by one before it is probed again
MIN_PROBE = 1200  # bytes: a probe datagram is at least QUIC's smallest, so an answer is a sixtieth of it at most
ANSWERS_PER_SECOND = 200.0  # a port answers at most this many probe datagrams per second (burst: the same)


@dataclass
class _Path:
    proven: bool = False  # GSO messages arrive whole on this path
    nonce: bytes = b""  # the current round's; empty: no round under way
    started: float = 0.0  # when the round (or, with no round, the verdict) began
    sent: int = 0  # probes sent in the round
    heard: set[int] = field(default_factory=set)
    failed: bool = False  # the last round went unanswered


class GsoPaths:
    """Per peer address: whether runs may go as GSO messages. ``use`` before each run, ``on_datagram`` for
    every datagram that starts with a zero byte."""

    def __init__(self, on_verdict: Callable[[Any, bool], None] | None = None,
                 random: Callable[[int], bytes] = os.urandom) -> None:
        """``on_verdict(addr, proven)`` is called when a path is proven or fails a round."""
        self._paths: dict[Any, _Path] = {}
        self._rounds: dict[bytes, Any] = {}  # nonce -> address
        self._on_verdict = on_verdict
        self._random = random
        self._tokens, self._filled = ANSWERS_PER_SECOND, 0.0

    def proven(self) -> list[Any]:
        """The addresses whose paths take GSO now."""
        return [addr for addr, p in self._paths.items() if p.proven]

    def use(self, addr: Any, size: int, now: float) -> tuple[bool, bytes | None]:
        """Whether a run of ``size``-byte datagrams to ``addr`` may go as GSO messages now, and a probe to send
        first (one GSO message of ``SEGMENTS`` datagrams of ``size`` bytes), if one is due."""
        p = self._paths.get(addr)
        if p is None:
            p = self._paths[addr] = _Path(started=now)
        if p.nonce:  # a round under way
            if len(p.heard) == SEGMENTS:
                self._end(addr, p, True, now)
            elif now - p.started >= TRIES * SPACING + SPACING:  # the last probe had a spacing to come back
                self._end(addr, p, False, now)
            elif p.sent < TRIES and now - p.started >= p.sent * SPACING:
                p.sent += 1
                return p.proven, self._probe(p.nonce, size)
            return p.proven, None
        if now - p.started >= (RECHECK if p.proven else RETRY) or not (p.proven or p.failed):
            p.nonce, p.started, p.sent, p.heard = self._random(NONCE), now, 1, set()
            self._rounds[p.nonce] = addr
            return p.proven, self._probe(p.nonce, size)
        return p.proven, None

    def on_datagram(self, data: bytes, now: float) -> bytes | None:
        """A datagram that is no QUIC packet: a probe gets its answer (to send back to where it came from), an
        answer counts for its round; anything else is None."""
        head, rest = data[:len(PROBE)], data[len(PROBE):]
        if len(rest) < NONCE + 1:
            return None
        if head == PROBE and len(data) >= MIN_PROBE:
            self._tokens = min(ANSWERS_PER_SECOND, self._tokens + max(0.0, now - self._filled) * ANSWERS_PER_SECOND)
            self._filled = max(now, self._filled)
            if self._tokens < 1:
                return None
            self._tokens -= 1
            return ANSWER + rest[:NONCE + 1]
        if head == ANSWER:
            addr = self._rounds.get(bytes(rest[:NONCE]))
            p = self._paths.get(addr)
            if p is not None and p.nonce == rest[:NONCE] and rest[NONCE] < SEGMENTS:
                p.heard.add(rest[NONCE])
        return None

    def _end(self, addr: Any, p: _Path, ok: bool, now: float) -> None:
        self._rounds.pop(p.nonce, None)
        changed = ok != p.proven or (not ok and not p.failed)
        p.proven, p.failed, p.nonce, p.started = ok, not ok, b"", now
        if changed and self._on_verdict is not None:
            self._on_verdict(addr, ok)

    @staticmethod
    def _probe(nonce: bytes, size: int) -> bytes:
        return b"".join((PROBE + nonce + bytes([i])).ljust(size, b"\x00") for i in range(SEGMENTS))
