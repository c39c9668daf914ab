"""The engine interface: what the mesh asks of one QUIC connection, whichever engine runs it (aioquic through
``aioquic_engine``, the compiled ngtcp2 engine through ``ngtcp2.mesh_connection``). Sans-IO, as the mesh:
time is an argument, datagrams and events are returned as data.

Messages, not streams: ``send(head, body)`` queues one message (a HELLO, or a numbered part: its header,
then its payload) on a stream of its own and returns its handle; the handle stays in ``live()`` until the
peer acknowledged all of it. What arrives comes as events:

* ``Handshaken``: the TLS handshake completed (``resumed``: a session ticket was used; ``early_data``: the
  first flight's 0-RTT data was taken).
* ``Received``: bytes of the message on ``stream``. ``end``: they end it (a whole message, or its last
  piece). An engine that ``places`` gives a long message's head alone (``end`` False); ``place`` then puts
  the rest where the mesh says, and ``Placed`` follows once it is all there. One that does not gives the
  message in pieces, in order, each a ``Received``.
* ``Placed``: the rest of the message on ``stream`` is in the buffer ``place`` gave.
* ``Closed``: the connection is over (``code`` and ``reason`` as the close said them; ``idle``: it ended
  by its idle timeout, nothing having come for that long, so a redial may find the peer again).

Session tickets go through the two callbacks a factory is given (the dialler's ``session_ticket_handler``
gets one for its next connection; a listener's ``session_ticket_fetcher(label)`` is asked for the ticket a
dialler offers and may return None): aioquic asks for them; the compiled engine seals its own tickets and
never asks. Who the peer is comes from ``peer_identity`` (its certificate, checked against the job's CA by
the mesh's ``identify``) or, on a resumed session, from the ticket.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any, Protocol

import attrs

NO_ERROR = 0x0  # a QUIC transport error code: the connection closed without an error


@attrs.frozen
class Handshaken:
    resumed: bool = False
    early_data: bool = False


@attrs.frozen
class Received:
    stream: int
    data: Any  # bytes or a read-only memoryview of the engine's own buffer
    end: bool


@attrs.frozen
class Placed:
    stream: int


@attrs.frozen
class Closed:
    code: int
    reason: str
    idle: bool = False


Event = Handshaken | Received | Placed | Closed


class EngineConnection(Protocol):
    """One QUIC connection as the mesh drives it. A factory makes it with keywords: ``configuration`` (the
    ``tls.configure`` settings: certificates, CA, ALPN, controller, timeouts, a ticket to resume with),
    ``session_ticket_handler``, and for an accepted connection ``original_destination_connection_id``,
    ``retry_source_connection_id`` (the Retry this endpoint answered with, or None) and
    ``session_ticket_fetcher``."""

    places: bool  # a long message's rest can go straight where ``place`` says
    holds: bool  # ``send`` keeps the caller's ``body`` (not copied) until its handle leaves ``live()``

    # ---- datagrams and time
    def connect(self, addr: Any, now: float) -> None:
        """Dialler: start the handshake with the peer at ``addr``."""

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None: ...

    def datagrams_to_send(self, now: float) -> list[tuple[Any, Any]]:
        """(datagram, address) pairs; a datagram is ``bytes`` or an engine's run of them."""

    def get_timer(self) -> float | None: ...

    def handle_timer(self, now: float) -> None: ...

    # ---- messages
    def send(self, head: bytes, body: Any = b"") -> int:
        """Queue ``head`` then ``body`` as one message on a stream of its own; its handle (in ``live()``
        until acknowledged). Where ``holds``, the engine reads ``body`` where it is until then: the caller
        leaves it unchanged; else it is copied and may be reused once this returns."""

    def ping(self) -> None:
        """Something the peer must acknowledge (a probe of a silent path)."""

    def place(self, stream: int, target: memoryview) -> None:
        """Where ``places``: the rest of the message whose head came last on ``stream`` goes into ``target``
        (``Placed`` follows); if it came whole meanwhile, it comes as ``Received`` after all."""

    def live(self) -> Container[int]:
        """Handles of messages sent and not yet acknowledged in full."""

    def next_event(self) -> Event | None: ...

    def close(self, code: int = NO_ERROR, reason: str = "") -> None:
        """End the connection; the peer learns ``code`` and ``reason`` from the next datagrams."""

    # ---- state and identity
    def took_nothing(self) -> bool:
        """An accepted connection that could read nothing of its first datagram."""

    def ended(self) -> bool:
        """Closing, draining or over: nothing more is read from it."""

    def end_reason(self) -> str:
        """Once ``ended``: why, as the close said it."""

    def free(self) -> None:
        """The mesh is done with it: its memory goes now, not when the collector runs."""

    def demux_token(self) -> int | None:
        """The token the endpoint's receive fast path reports for this connection; None: it has none."""

    def peer_address(self) -> Any: ...

    def host_cids(self) -> list[bytes]:
        """This end's connection ids (a datagram to this connection carries one)."""

    def peer_identity(self) -> tuple[Any, list[Any]]:
        """The peer's certificate and chain (cryptography objects) once the handshake is done."""

    def session_resumed(self) -> bool: ...

    def skip_client_certificate(self) -> None:
        """Listener, from ``session_ticket_fetcher``: the dialler resumes a session proven before."""

    def rtt(self) -> float | None:
        """The smoothed round-trip time (seconds); None before the handshake measured one."""

    def bandwidth(self) -> float | None:
        """The bottleneck bandwidth (bytes/s) a model-based controller measured; None for cubic and reno."""

    def describe(self) -> str:
        """The congestion controller's state, for the log."""
