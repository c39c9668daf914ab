"""What a rank keeps about one peer across QUIC connections: the queue of messages to send, the parts
handed to QUIC and not yet acknowledged (kept, numbered, so a new connection can send them again), the
incoming side (``Inbound``), the listener's latest session ticket, and the reconnection state.

A connection to a live peer can end without either process failing: an outage longer than
``idle_timeout``, or a NAT that forgot the path. When it ends by idle timeout and ``reconnect_timeout`` is
above zero, the dialling rank dials again, resuming the TLS session with the ticket the listener gave it
(0-RTT: the HELLO and every unacknowledged part leave in the first flight), and the listener waits for it.
Both sides then send again what QUIC had not acknowledged; the receiver drops parts it already has. A peer
that does not come back within the timeout is lost, as before. Runs on the endpoint's loop thread only.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from aioquic.tls import SessionTicket

from erdma_core.errors import PeerLostError
from erdma_core.transport.mailbox import Request

from .streams import Inbound, numbered

if TYPE_CHECKING:
    from .session import PeerSession
    from .transport import QuicTransport

log = logging.getLogger("erdma.quic")


class Outgoing:
    """One message waiting to be handed to QUIC: its streams, and the request that completes when it has."""

    __slots__ = ("done", "parts", "req")

    def __init__(self, parts: list[tuple[bytes, Any]], req: Request) -> None:
        self.parts, self.req, self.done = parts, req, 0


class Link:
    def __init__(self, transport: QuicTransport, rank: int, addr: Any, dialler: bool) -> None:
        self.t = transport
        self.rank = rank
        self.addr = addr
        self.dialler = dialler  # this rank dials the peer (and redials it)
        self.session: PeerSession | None = None  # the connection now carrying the link
        self.queue: deque[Outgoing] = deque()
        self.unacked: dict[int, tuple[bytes, bytes]] = {}  # part number -> (prefix and header, payload)
        self.keep = transport.reconnect_timeout > 0  # keep unacknowledged parts for a resend
        self.next_number = 1
        self.inflight = 0
        self.sent_frames = 0
        assert transport.mailbox is not None
        self.inbound = Inbound(transport.rank, rank, transport.mailbox, lambda h: None, sink=transport.sink)
        self.ticket: SessionTicket | None = None  # dialler: the listener's latest, for resumption
        self.dead = False
        self.down_since: float | None = None
        self.stats = {"reconnects": 0, "resumed": 0, "early_data": 0, "resent_parts": 0}

    # ---- connections ---------------------------------------------------------------------------------
    def attach(self, session: PeerSession) -> None:
        """``session`` carries the link from now on; a connection it replaces is dropped without a word
        (its peer has already given it up)."""
        old, self.session = self.session, session
        if old is not None and old is not session:
            old.detached()
        session.link = self
        self.inbound.on_hello = session.on_hello
        self.inbound.reset()
        session.open_streams.clear()
        self.inflight = 0

    def go(self, session: PeerSession) -> None:
        """``session`` may carry data: what QUIC had not acknowledged on the last connection goes first."""
        session.ready = True
        for number in sorted(self.unacked):
            head, body = self.unacked[number]
            self._send(session, number, head, body)
            self.stats["resent_parts"] += 1
        if session.established:
            self.back(session)
        self.t.endpoint.touch(session)

    def back(self, session: PeerSession) -> None:
        """The peer answered on ``session``: an outage, if there was one, is over."""
        if self.down_since is None or session is not self.session:
            return
        waited = self.t.endpoint.now - self.down_since
        self.down_since = None
        self.stats["reconnects"] += 1
        log.warning("rank %d: connection to rank %d back after %.2f s (%s); %d parts sent again",
                    self.t.rank, self.rank, waited, "TLS session resumed" if session.resumed else "full handshake",
                    len(self.unacked))

    def ended(self, session: PeerSession, why: str, reconnectable: bool) -> None:
        """The connection carrying the link is gone."""
        if session is not self.session:
            return
        self.session = None
        t = self.t
        if self.dead or t.closing or self.inbound.closed_cleanly:
            return
        if not (reconnectable and t.reconnect_timeout > 0):
            t.lost(self, why)
            return
        now = t.endpoint.now
        if self.down_since is None:
            self.down_since = now
            log.warning("rank %d: connection to rank %d ended (%s); %s for %.1f s", t.rank, self.rank, why,
                        "redialling" if self.dialler else "waiting for it to redial", t.reconnect_timeout)
            # the listener also allows for the dialler noticing the outage up to one idle timeout later
            grace = t.reconnect_timeout + (0 if self.dialler else t.opts["idle_timeout"])
            t.endpoint.loop.call_later(grace, self._give_up, self.down_since, why)
        if self.dialler:
            t.endpoint.loop.call_later(0.05, self._redial)

    def _redial(self) -> None:
        if self.session is None and not self.dead and not self.t.closing:
            self.t.redial(self)

    def _give_up(self, since: float, why: str) -> None:
        if self.down_since != since or self.dead:
            return  # back since, or already lost
        attempt, self.session = self.session, None
        if attempt is not None:  # a redial still waiting for an answer
            attempt.detached()
        self.t.lost(self, f"{why}; no new connection within {self.t.reconnect_timeout:.1f} s")

    # ---- sending -------------------------------------------------------------------------------------
    def enqueue(self, item: Outgoing, first: bool = False) -> None:
        if self.dead:
            item.req.complete(PeerLostError(f"rank {self.t.rank}: the connection to rank {self.rank} is closed",
                                            peer=self.rank, rank=self.t.rank))
            return
        if first:
            self.queue.appendleft(item)
        else:
            self.queue.append(item)
        if self.session is not None:
            self.t.endpoint.touch(self.session)

    def pump(self, session: PeerSession) -> bool:
        """Count what the peer acknowledged, then hand QUIC more while the window allows; True if it did."""
        if session is not self.session or not session.ready or self.dead:
            return False
        if session.open_streams:
            live = session.conn._streams
            for sid in [s for s in session.open_streams if s not in live]:
                number, size = session.open_streams.pop(sid)
                self.inflight -= size
                self.unacked.pop(number, None)
        window = self.t.window
        pushed = False
        while self.queue and self.inflight < window:
            pushed = True
            item = self.queue[0]
            head, body = item.parts[item.done]
            number = self.next_number
            self.next_number += 1
            head = numbered(head, number)
            if self.keep:
                body = bytes(body)  # the caller may reuse its buffer once the request completes
                self.unacked[number] = (head, body)
            self._send(session, number, head, body)
            item.done += 1
            if item.done == len(item.parts):
                self.queue.popleft()
                item.req.complete()
        return pushed

    def _send(self, session: PeerSession, number: int, head: bytes, body: Any) -> None:
        conn = session.conn
        sid = conn.get_next_available_stream_id(is_unidirectional=True)
        conn.send_stream_data(sid, head)
        conn.send_stream_data(sid, body, end_stream=True)
        size = len(head) + len(body)
        session.open_streams[sid] = (number, size)
        self.inflight += size

    def fail(self, error: BaseException) -> None:
        self.dead = True
        self.unacked.clear()
        while self.queue:
            self.queue.popleft().req.complete(error)
