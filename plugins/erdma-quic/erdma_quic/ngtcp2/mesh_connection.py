"""The compiled engine behind the engine interface (``engine.EngineConnection``) over one
``connection.Connection``. The mesh's logic (who the peer is, HELLO, numbered parts, reconnection, candidate
addresses) is the same for both engines; only this adapter and aioquic's (``aioquic_engine``) differ.

What differs from aioquic, said where it shows:

* A message leaves as one: ``send(head, body)`` hands both to the engine, which reads them where they are
  (not copied) until the peer acknowledged them (``holds``: the mesh copies a short part, and keeps a long
  one's request open until then). A long message's head (``streams.HEAD_BYTES``) comes
  as a ``Received`` of its own, and the rest goes where ``place`` says (the frame's buffer: the engine
  decrypts into packets and copies from there once), ending in ``Placed``; a message no ``place`` took (a
  HELLO, a duplicate) comes whole.
* Session tickets are GnuTLS's: sealed with keys only the listener's endpoint holds (``Tickets``), carrying
  the certificate the dialler proved, so the listener reads who resumes from ``peer_identity`` as after a
  full handshake; the mesh never sees a ticket's label (no ``session_ticket_fetcher``). A first flight's
  0-RTT data is taken once (GnuTLS's anti-replay, remembered for a ticket's life); a replayed one is read
  as a resumption without early data, which the replayer cannot complete.
* ``ping`` sends an empty message (ack-eliciting, as a PING is); the receiving end drops empty messages.
"""

from __future__ import annotations

import functools
import itertools
import ssl
from collections.abc import Callable
from typing import Any

from aioquic.quic.configuration import QuicConfiguration
from aioquic.tls import CipherSuite
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from .. import engine as api
from ..streams import HEAD_BYTES, close_reason
from .connection import Acked, Closed, Config, Connection, Demux, Handshaken, Head, Message, Placed, Run, Ticket, Tickets

PRIORITY_BASE = "NORMAL:-VERS-ALL:+VERS-TLS1.3:-CIPHER-ALL"
GNUTLS_CIPHER = {
    CipherSuite.AES_128_GCM_SHA256: "+AES-128-GCM",
    CipherSuite.AES_256_GCM_SHA384: "+AES-256-GCM",
    CipherSuite.CHACHA20_POLY1305_SHA256: "+CHACHA20-POLY1305",
}
PLACE_FROM = 1 << 20  # a stream this long lands in place (a shorter one, whole: its Python events cost more)
CONTROLLER = {"bbr": "bbr", "cubic": "cubic", "reno": "reno"}  # erdma-quic's option -> ngtcp2's controller


@functools.lru_cache(maxsize=8)
def _pem(cert: x509.Certificate, key: Any) -> tuple[bytes, bytes]:
    """A rank's certificate and key in PEM, made once per credentials (not per connection)."""
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


class EngineFactory:
    """Makes one endpoint's connections (``mesh.Mesh(connection=...)``): they share its listener's ticket keys
    and its connection-id table ``demux``, whose ``receive`` the endpoint's socket side reads with. ``runs``:
    the socket side sends ``Run`` objects itself (a plain socket), so connections hand out runs of datagrams
    rather than one ``bytes`` each."""

    def __init__(self) -> None:
        self.tickets, self.demux = Tickets(), Demux()
        self.runs = False
        self._tokens = itertools.count(1)

    def __call__(self, **kw: Any) -> EngineConnection:
        return EngineConnection(tickets=self.tickets, demux=self.demux, token=next(self._tokens), runs=self.runs,
                                **kw)


def engine_config(c: QuicConfiguration, tickets: Tickets | None = None, demux: Demux | None = None,
                  token: int = 0) -> Config:
    """The engine's settings from the aioquic configuration ``tls.Tls.configure`` makes for each connection
    (its ``session_ticket``: a ticket this engine gave, or None); ``tickets``: the listener's ticket keys."""
    pem = _pem(c.certificate, c.private_key)
    verify = c.verify_mode == ssl.CERT_REQUIRED
    ca = c.cadata if verify else None
    if isinstance(ca, str):
        ca = ca.encode()
    ciphers = ":".join(GNUTLS_CIPHER[s] for s in (c.cipher_suites or GNUTLS_CIPHER) if s in GNUTLS_CIPHER)
    return Config(cert_pem=pem[0], key_pem=pem[1], ca_pem=ca, datagram=c.max_datagram_size,
                  cc=CONTROLLER[c.congestion_control_algorithm], window=c.max_data, stream_window=c.max_stream_data,
                  server_name=c.server_name if verify and c.is_client else None,
                  priority=f"{PRIORITY_BASE}:{ciphers}", idle_timeout=c.idle_timeout, check_client=False,
                  handshake_timeout=c.idle_timeout, tickets=None if c.is_client else tickets,
                  ticket=c.session_ticket if c.is_client and isinstance(c.session_ticket, bytes) else None,
                  demux=demux, token=token, head=HEAD_BYTES, place_from=PLACE_FROM)


def _local_for(addr: Any) -> tuple[str, int]:
    return ("::", 0) if ":" in addr[0] else ("0.0.0.0", 0)


class EngineConnection:
    """``engine.EngineConnection`` on the compiled engine; made with the interface's keywords."""

    def __init__(self, *, configuration: QuicConfiguration, original_destination_connection_id: bytes | None = None,
                 retry_source_connection_id: bytes | None = None, session_ticket_fetcher: Any = None,
                 session_ticket_handler: Callable[[bytes], None] | None = None, tickets: Tickets | None = None,
                 demux: Demux | None = None, token: int = 0, runs: bool = False) -> None:
        """``session_ticket_handler(ticket)``: the dialler got a ticket (bytes) for its next connection;
        ``retry_source_connection_id`` (listener): the id of the Retry this endpoint answered the client's first
        Initial with, whose destination id was ``original_destination_connection_id`` (None: no Retry);
        ``tickets``: the listener's keys (its endpoint's, shared by every connection it accepts); ``demux``
        the endpoint's connection-id table, where ``token`` names this connection; ``runs``: hand out
        ``Run`` objects (whole batches) from ``datagrams_to_send``, not one ``bytes`` per datagram."""
        self._config = engine_config(configuration, tickets, demux, token)
        self._retried = original_destination_connection_id if retry_source_connection_id is not None else None
        self.token = token if demux is not None else None
        self._runs = runs
        self._on_ticket = session_ticket_handler
        self._client = configuration.is_client
        self._engine: Connection | None = None
        self._failed_first = False  # an accepted connection whose first datagram opened nothing
        self._next = 0  # the handle the engine gives the next message (pings included)
        self._live: set[int] = set()  # streams sent and not yet acknowledged
        self._peer: tuple[Any, list[Any]] | None = None
        self._headed: dict[int, Head] = {}  # stream -> the head given of the message under way there
        self._now = 0.0  # the latest time the mesh gave (a close takes none)
        self._ended = ""  # why, once the engine said ``Closed``

    # ---- datagrams and time ----------------------------------------------------------------------------
    def connect(self, addr: Any, now: float) -> None:
        self._now = now
        self._engine = Connection.dial(self._config, _local_for(addr), (addr[0], addr[1]), now)

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None:
        self._now = now
        remote = (addr[0], addr[1])
        if self._engine is None:
            if self._client or self._failed_first:
                return
            try:
                self._engine = Connection.accept(self._config, _local_for(addr), remote, data, now, self._retried)
            except ConnectionError:
                self._failed_first = True
            return
        self._engine.receive_datagram(data, now, remote)  # a new address is taken once ngtcp2 validated it

    def took_nothing(self) -> bool:
        return self._engine is None

    def ended(self) -> bool:
        return self._engine is None or self._engine.ended

    def end_reason(self) -> str:
        return self._ended or "closed"

    def free(self) -> None:
        """The mesh is done with this connection: the engine's memory goes now, not when the collector runs."""
        engine, self._engine = self._engine, None
        self._on_ticket = None
        self._headed.clear()
        if engine is not None:
            engine.free()

    def demux_token(self) -> int | None:
        """What the endpoint's ``Demux.receive`` reports when it handed this connection datagrams itself."""
        return self.token

    def datagrams_to_send(self, now: float) -> list[tuple[bytes | Run, Any]]:
        self._now = now
        if self._engine is None:
            return []
        if self._runs:
            return [(run, to) for to, run in self._engine.runs(now)]
        return [(d, to) for to, run in self._engine.batches(now) for d in run]

    def get_timer(self) -> float | None:
        return self._engine.get_timer() if self._engine is not None else None

    def handle_timer(self, now: float) -> None:
        self._now = now
        if self._engine is not None:
            self._engine.handle_timer(now)

    def peer_address(self) -> Any:
        return self._engine.remote if self._engine is not None else None

    # ---- messages ----------------------------------------------------------------------------------------
    def send(self, head: bytes, body: Any = b"") -> int:
        assert self._engine is not None, "send before connect"
        self._engine.send(head, body)
        handle, self._next = self._next, self._next + 1
        self._live.add(handle)
        return handle

    def ping(self) -> None:
        if self._engine is not None:
            try:
                self._engine.send(b"")
            except ConnectionError:
                return
            self._next += 1

    places = True  # ``place`` puts a stream's rest where the mesh says
    holds = True  # ``send`` reads the caller's memory until the peer acknowledged it (no copy)

    def place(self, stream: int, target: memoryview) -> None:
        head = self._headed.pop(stream, None)
        if head is not None and self._engine is not None:
            self._engine.place(head, target)

    def live(self) -> set[int]:
        return self._live

    def next_event(self) -> api.Event | None:
        while self._engine is not None and (ev := self._engine.next_event()) is not None:
            if isinstance(ev, Message):
                self._headed.pop(ev.stream, None)
                if ev.data:
                    return api.Received(ev.stream, ev.data, True)
            elif isinstance(ev, Head):
                self._headed[ev.stream] = ev
                return api.Received(ev.stream, ev.data, False)
            elif isinstance(ev, Placed):
                return api.Placed(ev.stream)
            elif isinstance(ev, Acked):
                self._live.discard(ev.handle)
            elif isinstance(ev, Handshaken):
                return api.Handshaken(self._engine.resumed, self._engine.early_data_accepted)
            elif isinstance(ev, Ticket):
                if self._on_ticket is not None:
                    self._on_ticket(ev.data)
            elif isinstance(ev, Closed):
                self._live.clear()
                self._ended = close_reason(ev.code, ev.reason)
                if ev.origin == "idle":
                    return api.Closed(ev.code, "Idle timeout", idle=True)
                return api.Closed(ev.code, ev.reason)
        return None

    def close(self, code: int = api.NO_ERROR, reason: str = "") -> None:
        if self._engine is not None:
            self._engine.close(code, reason, self._now)

    # ---- identity and state --------------------------------------------------------------------------
    def host_cids(self) -> list[bytes]:
        return self._engine.connection_ids() if self._engine is not None else []

    def peer_identity(self) -> tuple[Any, list[Any]]:
        if self._peer is None:
            der = self._engine.peer_certificate() if self._engine is not None else None
            self._peer = (x509.load_der_x509_certificate(der) if der else None, [])
        return self._peer

    def session_resumed(self) -> bool:
        return self._engine is not None and self._engine.resumed

    def skip_client_certificate(self) -> None:
        """Never called: the mesh calls it from ``session_ticket_fetcher``, which this engine has no use for (a
        resumed session asks for no certificate; the ticket carries the one proven before)."""

    def rtt(self) -> float | None:
        return self._engine.rtt if self._engine is not None and self._engine.handshake_done else None

    def bandwidth(self) -> float | None:
        """The delivery rate ngtcp2's BBR measured (bytes/s); cubic and reno: None, as with aioquic."""
        if self._engine is None or not self._config.cc.startswith("bbr"):
            return None
        return self._engine.delivery_rate

    def describe(self) -> str:
        if self._engine is None:
            return "not started"
        return f"ngtcp2 {self._config.cc}, cwnd {self._engine.cwnd} B, srtt {self._engine.rtt:.5f} s"
