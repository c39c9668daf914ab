"""One QUIC connection as the transport sees it: who is at the other end (a certificate checked at the
handshake, or a session ticket this rank issued to an identified peer), the HELLO exchange, and events
handed to the peer's ``Link``, which outlives connections. Runs on the endpoint's loop thread only."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from aioquic.quic import events
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode
from aioquic.tls import SessionTicket

from erdma_core.errors import ProtocolError
from erdma_core.transport.wire import HELLO_ACCEPTED, Hello

from .congestion import attach
from .credentials import CredentialError, check_peer
from .link import Link
from .streams import Inbound, hello_stream

if TYPE_CHECKING:
    from .transport import QuicTransport

log = logging.getLogger("erdma.quic")
REFUSED = 0x0100  # application close code: credentials or HELLO refused
UNREACHABLE_GRACE = 0.5  # seconds a peer whose port is unreachable has to be heard from again


class Connection(QuicConnection):
    """aioquic's connection, with listeners asking the dialler for its certificate (mutual TLS), and the
    model-based controller's own pacer when that controller is configured."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        attach(self)

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        if not self._is_client:
            self.tls._request_client_certificate = True


class PeerSession:
    def __init__(self, transport: QuicTransport, rank: int | None, addr: Any) -> None:
        self.t = transport
        self.conn: Connection = None  # type: ignore[assignment]  # set by the transport right after
        self.rank = rank  # None for an accepted connection until its certificate or ticket names it
        self.addr = addr
        self.dialled = rank is not None
        self.link: Link | None = None
        self.pre = Inbound(transport.rank, -1, None, self.on_hello)  # before the peer is identified: HELLO only
        self.open_streams: dict[int, tuple[int, int]] = {}  # stream id -> (part number, bytes)
        self.ready = False  # carries the link's data
        self.failure: str | None = None
        self.terminated = False
        self.resumed = False  # TLS session resumed from a ticket
        self.established = False  # the peer has answered (dialler: handshake done; listener: identified)
        self.last_rx = 0.0
        self._suspect = False
        self._ticket_rank: int | None = None  # listener: the rank the offered ticket was issued to
        self._issued: SessionTicket | None = None  # listener: a ticket issued before the peer was identified

    # ---- session tickets (TLS resumption) ------------------------------------------------------------
    def fetch_ticket(self, label: bytes) -> SessionTicket | None:
        """Listener: the dialler offers a ticket. Each is good once (a replayed first flight finds it gone)."""
        found = self.t.tickets.pop(label, None)
        if found is None:
            return None
        ticket, rank = found
        link = self.t.links.get(rank)
        if link is None or link.dead:
            return None
        self._ticket_rank = rank
        self.conn.tls._request_client_certificate = False  # resumption carries the identity proven before
        return ticket

    def issued_ticket(self, ticket: SessionTicket) -> None:
        if self.dialled:
            if self.link is not None:
                self.link.ticket = ticket
        elif self.link is not None:
            self.t.keep_ticket(ticket, self.link.rank)
        else:
            self._issued = ticket

    # ---- events --------------------------------------------------------------------------------------
    def on_events(self) -> None:
        if (self._ticket_rank is not None and self.link is None and not self.terminated
                and self.conn.tls.session_resumed):
            self.resumed = True
            self._identified(self._ticket_rank)
        while (ev := self.conn.next_event()) is not None:
            if isinstance(ev, events.StreamDataReceived):
                link = self.link
                if self.failure is not None or self.terminated:
                    continue  # refused: closing, nothing more is read
                if link is None or link.session is not self:
                    if self.t.verify:  # identification comes from the handshake, before any stream
                        self.refuse("sent stream data before it was identified")
                        continue
                    inbound = self.pre  # insecure mode: the HELLO names the peer
                else:
                    inbound = link.inbound
                try:
                    inbound.feed(ev.stream_id, ev.data, ev.end_stream)
                except ProtocolError as exc:
                    if self.ready and link is not None:
                        self.t.lost(link, f"broke the protocol: {exc}")
                    else:
                        self.refuse(f"broke the protocol: {exc}")
            elif isinstance(ev, events.HandshakeCompleted):
                self._handshake_done(ev)
            elif isinstance(ev, events.ConnectionTerminated):
                self._terminated(ev)

    def _handshake_done(self, ev: events.HandshakeCompleted) -> None:
        if self.dialled:
            self.resumed, self.established = ev.session_resumed, True
            if self.link is not None and ev.session_resumed:
                self.link.stats["resumed"] += 1
                self.link.stats["early_data"] += int(ev.early_data_accepted)
            if self.link is not None:
                self.link.back(self)
            return
        if self.link is not None or not self.t.verify:  # identified by its ticket, or (insecure) by HELLO
            return
        tls = self.conn.tls
        try:
            rank = check_peer(tls._peer_certificate, tls._peer_certificate_chain, self.t.ca_pem,
                              self.t.job, self.t.diallers())
        except CredentialError as exc:
            self.refuse(str(exc))
            return
        self._identified(rank)

    def _identified(self, rank: int) -> None:
        """Listener: the peer proved it is ``rank``; a new link, or an existing one that it reconnects."""
        t = self.t
        link = t.links.get(rank)
        if link is not None and link.dead:
            self.refuse(f"rank {rank} was already given up as lost")
            return
        self.rank, self.established = rank, True
        if link is None:
            link = Link(t, rank, self.addr, dialler=False)
        link.attach(self)
        if self._issued is not None:
            t.keep_ticket(self._issued, rank)
        if t.links.get(rank) is link:  # a reconnection
            t.settled(self)
            if t.verify:
                link.go(self)  # what was not acknowledged goes again now

    def on_hello(self, hello: Hello) -> None:
        t = self.t
        if self.dialled:
            if hello.status != HELLO_ACCEPTED or hello.rank != self.rank:
                self.refuse(f"answered HELLO with status {hello.status} as rank {hello.rank}")
                return
            assert self.link is not None
            if not self.ready:
                self.link.go(self)
            if t.links.get(self.link.rank) is not self.link:
                t.joined(self.link)
            return
        why = None
        if hello.job != t.job or hello.world != t.world_size:
            why = f"job {hello.job:#x} world {hello.world} (this job {t.job:#x}, world {t.world_size})"
        elif self.rank is not None and hello.rank != self.rank:
            why = f"its HELLO says rank {hello.rank}, its certificate rank {self.rank}"
        elif self.rank is None and hello.rank not in t.diallers():
            why = f"rank {hello.rank} is not expected here"
        if why is not None:
            self.refuse(why)
            return
        if self.link is None:
            self._identified(hello.rank)
            if self.link is None:
                return
        self.send_raw(hello_stream(Hello(HELLO_ACCEPTED, t.job, t.rank, t.world_size)))
        if not self.ready:
            self.link.go(self)
        if t.links.get(self.link.rank) is not self.link:
            t.joined(self.link)

    def refuse(self, why: str) -> None:
        who = f"rank {self.rank}" if self.rank is not None else "a peer"
        log.warning("rank %d: refused the QUIC connection of %s at %s: %s", self.t.rank, who, self.addr, why)
        self.failure = why
        self.conn.close(error_code=REFUSED, reason_phrase=why[:200])

    def _terminated(self, ev: events.ConnectionTerminated) -> None:
        if self.terminated:
            return
        self.terminated = True
        self.t.endpoint.forget(self)
        reason = ev.reason_phrase or f"error code {ev.error_code:#x}"
        link = self.link
        if link is not None and link.session is self and (self.ready or link.down_since is not None):
            idle = ev.error_code == QuicErrorCode.INTERNAL_ERROR and ev.reason_phrase == "Idle timeout"
            why = f"refused the connection: {reason}" if ev.error_code == REFUSED else f"connection ended ({reason})"
            link.ended(self, why, reconnectable=idle)
            return
        if self.failure is None:
            self.failure = f"refused the connection: {reason}" if ev.error_code == REFUSED else reason
        self.t.setup_failed(self)

    def detached(self) -> None:
        """Another connection took over this one's link: drop it without a word."""
        self.terminated = True
        self.ready = False
        self.t.endpoint.forget(self)

    def on_unreachable(self) -> None:
        """The peer's port answered ICMP 'unreachable'. Its process is gone unless it is heard from again
        within ``UNREACHABLE_GRACE`` (a path that changed under it, e.g. NAT rebinding, is not a death)."""
        link = self.link
        if self.terminated or self._suspect or link is None or link.session is not self:
            return
        if not (self.ready or link.down_since is not None):
            return
        self._suspect = True
        loop = self.t.endpoint.loop
        loop.call_later(UNREACHABLE_GRACE, self._confirm_unreachable, loop.time())

    def _confirm_unreachable(self, since: float) -> None:
        self._suspect = False
        link = self.link
        if self.terminated or self.last_rx > since or link is None or link.inbound.closed_cleanly:
            return
        self.terminated = True
        self.t.endpoint.forget(self)
        link.ended(self, "its port is unreachable (the process ended)", reconnectable=False)

    # ---- sending -------------------------------------------------------------------------------------
    def send_raw(self, data: bytes) -> None:
        sid = self.conn.get_next_available_stream_id(is_unidirectional=True)
        self.conn.send_stream_data(sid, data, end_stream=True)

    def after_io(self) -> bool:
        return self.link.pump(self) if self.link is not None else False
