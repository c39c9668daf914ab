"""Each peer's queue of message parts and what QUIC holds of it: the mesh's sending side, as functions of a
``Link`` and the ``Session`` that carries it. A part is numbered as it is handed to QUIC; up to
``Settings.window`` bytes per peer are in QUIC's hands and not yet acknowledged. A message's request
completes once QUIC has all its parts, copied; or, with an engine that ``holds`` the caller's memory, a
part of at least ``HOLD_FROM`` bytes and a round trip of at most ``HOLD_RTT``, once the peer acknowledged
them all: the payload is not copied. Where the copy costs less than the wait (a short part, or a long path,
where the link and not the CPU is the limit and a collective's step would wait a round trip more), the
request completes as soon as QUIC has the copy. Where the link may reconnect (``keep``),
each part is kept until the peer acknowledged it, so that a new connection sends again what the old one left
unacknowledged (the receiver drops the parts it already has, by number)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from erdma_core.sdk import Request

from .mesh_state import Link, Outgoing, Session
from .streams import numbered

HOLD_FROM = 512 << 10  # payload bytes from which a holding engine sends a part from the caller's memory ...
HOLD_RTT = 0.002  # ... over a connection whose smoothed round trip is at most this (seconds)


def queue(link: Link, parts: list[tuple[bytes, Any]], req: Request, urgent: bool) -> None:
    """A message's parts (``streams.message_parts``) wait for QUIC; ``urgent`` (an ABORT) goes first."""
    item = Outgoing(parts, req)
    if urgent:
        link.queue.appendleft(item)
    else:
        link.queue.append(item)


def fail(link: Link, error: BaseException) -> None:
    """Fail every message queued, or sent and waiting for its acknowledgement, with ``error`` (the peer is
    lost)."""
    while link.queue:
        link.queue.popleft().req.complete(error)
    for item in link.held.values():  # (a request completes once: parts of one message fail it once)
        item.req.complete(error)
    link.held.clear()


def pump(link: Link, s: Session, window: int) -> bool:
    """Count what the peer acknowledged on ``s``, then hand QUIC more while ``window`` allows; True if it did."""
    if s.open_streams:
        live = s.conn.live()
        for sid in [x for x in s.open_streams if x not in live]:
            number, size = s.open_streams.pop(sid)
            link.inflight -= size
            link.unacked.pop(number, None)
            if (item := link.held.pop(number, None)) is not None:
                item.held -= 1
                if not item.held and item.done == len(item.parts):
                    item.req.complete()
    pushed = False
    holds = s.conn.holds and (rtt := s.conn.rtt()) is not None and rtt <= HOLD_RTT
    while link.queue and link.inflight < window:
        pushed = True
        item = link.queue[0]
        head, body = item.parts[item.done]
        number = link.next_number
        link.next_number += 1
        head = numbered(head, number)
        if holds and len(body) >= HOLD_FROM:  # the request waits for the peer's acknowledgement instead
            link.held[number] = item
            item.held += 1
        elif s.conn.holds or link.keep:
            body = bytes(body)  # the caller may reuse its buffer once the request completes
        if link.keep:
            link.unacked[number] = (head, body)
        put(link, s, number, head, body)
        item.done += 1
        if item.done == len(item.parts):
            link.queue.popleft()
            if not item.held:
                item.req.complete()
    return pushed


def resend(link: Link, s: Session) -> None:
    """What QUIC had not acknowledged on the link's last connection goes first on ``s``, in order."""
    for number in sorted(link.unacked):
        head, body = link.unacked[number]
        put(link, s, number, head, body)
        link.stats["resent_parts"] += 1


def put(link: Link, s: Session, number: int, head: bytes, body: Any) -> None:
    sid = s.conn.send(head, body)
    size = len(head) + len(body)
    s.open_streams[sid] = (number, size)
    link.inflight += size


def flushed(links: Iterable[Link], lost: frozenset[int]) -> bool:
    """Nothing queued, and every part handed to QUIC acknowledged, on every live link but those to ``lost``."""
    return all(not link.queue and (link.session is None or not link.session.open_streams
                                   or link.session.terminated) for link in links
               if not link.dead and link.rank not in lost)
