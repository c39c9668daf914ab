"""One peer's QUIC connection as the transport sees it: identity checks at the handshake, the outgoing
message queue with its window, the incoming streams. Runs on the endpoint's loop thread only."""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from erdma_core.errors import PeerLostError, ProtocolError
from erdma_core.mailbox import Request
from erdma_core.wire import HELLO_ACCEPTED, HELLO_REQUEST, Hello

from .congestion import attach
from .credentials import CredentialError, check_peer
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


class Outgoing:
    """One message waiting to be handed to QUIC: its streams, and the request that completes when it has."""

    __slots__ = ("done", "parts", "req")

    def __init__(self, parts: list[tuple[bytes, Any]], req: Request) -> None:
        self.parts, self.req, self.done = parts, req, 0


class PeerSession:
    def __init__(self, transport: QuicTransport, conn: Connection, rank: int | None, addr: Any) -> None:
        self.t = transport
        self.conn = conn
        self.rank = rank  # None for an accepted connection until its certificate names it
        self.addr = addr
        self.dialled = rank is not None
        self.inbound: Inbound | None = None
        self.queue: deque[Outgoing] = deque()
        self.open_streams: dict[int, int] = {}
        self.inflight = 0
        self.ready = False
        self.failure: str | None = None
        self.terminated = False
        self.sent_frames = 0
        self.last_rx = 0.0
        self._suspect = False

    # ---- events --------------------------------------------------------------------------------------
    def on_events(self) -> None:
        while (ev := self.conn.next_event()) is not None:
            if isinstance(ev, events.StreamDataReceived):
                if self.inbound is None:
                    self.refuse("sent stream data before it was identified")
                    continue
                try:
                    self.inbound.feed(ev.stream_id, ev.data, ev.end_stream)
                except ProtocolError as exc:
                    if self.ready:
                        self.t.lost(self, f"broke the protocol: {exc}")
                    else:
                        self.refuse(f"broke the protocol: {exc}")
            elif isinstance(ev, events.HandshakeCompleted):
                self._handshake_done()
            elif isinstance(ev, events.ConnectionTerminated):
                self._terminated(ev)

    def _handshake_done(self) -> None:
        if self.dialled:
            self._open_inbound()
            self.send_raw(hello_stream(Hello(HELLO_REQUEST, self.t.job, self.t.rank, self.t.world_size)))
            return
        if self.t.verify:
            tls = self.conn.tls
            try:
                self.rank = check_peer(tls._peer_certificate, tls._peer_certificate_chain, self.t.ca_pem,
                                       self.t.job, self.t.awaiting())
            except CredentialError as exc:
                self.refuse(str(exc))
                return
        self._open_inbound()

    def _open_inbound(self) -> None:
        assert self.t.mailbox is not None
        self.inbound = Inbound(self.t.rank, self.rank if self.rank is not None else -1, self.t.mailbox, self._hello)

    def _hello(self, hello: Hello) -> None:
        t = self.t
        if self.dialled:
            if hello.status != HELLO_ACCEPTED or hello.rank != self.rank:
                self.refuse(f"answered HELLO with status {hello.status} as rank {hello.rank}")
                return
            t.joined(self)
            return
        why = None
        if hello.job != t.job or hello.world != t.world_size:
            why = f"job {hello.job:#x} world {hello.world} (this job {t.job:#x}, world {t.world_size})"
        elif self.rank is not None and hello.rank != self.rank:
            why = f"its HELLO says rank {hello.rank}, its certificate rank {self.rank}"
        elif self.rank is None and hello.rank not in t.awaiting():
            why = f"rank {hello.rank} is not expected here"
        if why is not None:
            self.refuse(why)
            return
        self.rank = hello.rank
        assert self.inbound is not None
        self.inbound.peer = hello.rank
        self.send_raw(hello_stream(Hello(HELLO_ACCEPTED, t.job, t.rank, t.world_size)))
        t.joined(self)

    def refuse(self, why: str) -> None:
        who = f"rank {self.rank}" if self.rank is not None else "a peer"
        log.warning("rank %d: refused the QUIC connection of %s at %s: %s", self.t.rank, who, self.addr, why)
        self.failure = why
        self.conn.close(error_code=REFUSED, reason_phrase=why[:200])

    def _terminated(self, ev: events.ConnectionTerminated) -> None:
        if self.terminated:
            return
        self.terminated = True
        reason = ev.reason_phrase or f"error code {ev.error_code:#x}"
        if not self.ready:
            if self.failure is None:
                self.failure = f"refused the connection: {reason}" if ev.error_code == REFUSED else reason
            self.t.setup_failed(self)
        elif not (self.inbound is not None and self.inbound.closed_cleanly) and not self.t.closing:
            self.t.lost(self, f"connection ended ({reason})")
        self.t.endpoint.forget(self)

    def on_unreachable(self) -> None:
        """The peer's port answered ICMP 'unreachable'. Its process is gone unless it is heard from again
        within ``UNREACHABLE_GRACE`` (a path that changed under it, e.g. NAT rebinding, is not a death)."""
        if not self.ready or self.terminated or self._suspect:
            return
        self._suspect = True
        loop = self.t.endpoint.loop
        loop.call_later(UNREACHABLE_GRACE, self._confirm_unreachable, loop.time())

    def _confirm_unreachable(self, since: float) -> None:
        self._suspect = False
        if self.terminated or self.last_rx > since or (self.inbound is not None and self.inbound.closed_cleanly):
            return
        self.terminated = True
        self.t.lost(self, "its port is unreachable (the process ended)")
        self.t.endpoint.forget(self)

    # ---- sending -------------------------------------------------------------------------------------
    def send_raw(self, data: bytes) -> None:
        sid = self.conn.get_next_available_stream_id(is_unidirectional=True)
        self.conn.send_stream_data(sid, data, end_stream=True)

    def enqueue(self, item: Outgoing, first: bool = False) -> None:
        if self.terminated:
            item.req.complete(PeerLostError(f"rank {self.t.rank}: the connection to rank {self.rank} is closed",
                                            peer=self.rank, rank=self.t.rank))
            return
        if first:
            self.queue.appendleft(item)
        else:
            self.queue.append(item)
        self.t.endpoint.touch(self)

    def after_io(self) -> bool:
        """Count what the peer acknowledged, then hand QUIC more while the window allows; True if it did."""
        if self.open_streams:
            live = self.conn._streams
            for sid in [s for s in self.open_streams if s not in live]:
                self.inflight -= self.open_streams.pop(sid)
        window = self.t.window
        pushed = False
        while self.queue and self.inflight < window and not self.terminated:
            pushed = True
            item = self.queue[0]
            head, body = item.parts[item.done]
            sid = self.conn.get_next_available_stream_id(is_unidirectional=True)
            self.conn.send_stream_data(sid, head)
            self.conn.send_stream_data(sid, body, end_stream=True)
            size = len(head) + len(body)
            self.open_streams[sid] = size
            self.inflight += size
            item.done += 1
            if item.done == len(item.parts):
                self.queue.popleft()
                item.req.complete()
        return pushed

    def fail_queue(self, error: BaseException) -> None:
        while self.queue:
            self.queue.popleft().req.complete(error)
