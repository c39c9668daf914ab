"""aioquic behind the engine interface (``engine.EngineConnection``): the reference engine, in pure Python.
Every use of aioquic's private attributes in the plugin's connection handling is here (the congestion
controller's pacer is ``congestion``'s; the Retry packets ``retry``'s).

What it adds to aioquic's ``QuicConnection``: a listener asks the dialler for its certificate (mutual TLS)
unless the dialler resumes a session; the model-based controller gets its own pacer; a stranger's failed
handshake is logged at DEBUG (the mesh reports it, at its pace). A message is a unidirectional stream; its
data comes in pieces (``places`` is False: aioquic hands stream data over as it decrypts it)."""

from __future__ import annotations

import logging
from collections.abc import Container
from typing import Any

from aioquic.quic import events
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.packet import QuicErrorCode

from .congestion import attach
from .engine import NO_ERROR, Closed, Event, Handshaken, Received
from .streams import close_reason

_ENDED = (QuicConnectionState.CLOSING, QuicConnectionState.DRAINING, QuicConnectionState.TERMINATED)


class Quic(QuicConnection):
    """aioquic's connection with mutual TLS and the model pacer (see the module's docstring)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        attach(self)
        if not self._is_client:
            self._logger = _Quiet(self._logger.logger, self._logger.extra)

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        if not self._is_client:
            self.tls._request_client_certificate = True


class _Quiet(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aioquic's connection log with its warnings (one per failed handshake) said at DEBUG."""

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.debug(msg, *args, **kwargs)


class AioquicConnection:
    """``engine.EngineConnection`` on aioquic; made with the interface's keywords (aioquic's own)."""

    places = False
    holds = False  # aioquic copies what it sends into its stream's buffer

    def __init__(self, **kw: Any) -> None:
        self.quic = Quic(**kw)

    # ---- datagrams and time ----------------------------------------------------------------------------
    def connect(self, addr: Any, now: float) -> None:
        self.quic.connect(addr, now=now)

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None:
        self.quic.receive_datagram(data, addr, now=now)

    def datagrams_to_send(self, now: float) -> list[tuple[Any, Any]]:
        return self.quic.datagrams_to_send(now=now)

    def get_timer(self) -> float | None:
        return self.quic.get_timer()

    def handle_timer(self, now: float) -> None:
        self.quic.handle_timer(now=now)

    # ---- messages ---------------------------------------------------------------------------------------
    def send(self, head: bytes, body: Any = b"") -> int:
        """aioquic copies what it is given into the stream's send buffer: the caller may reuse ``body``."""
        quic = self.quic
        sid = quic.get_next_available_stream_id(is_unidirectional=True)
        if len(body):
            quic.send_stream_data(sid, head)
            quic.send_stream_data(sid, body, end_stream=True)
        else:
            quic.send_stream_data(sid, head, end_stream=True)
        return sid

    def ping(self) -> None:
        self.quic.send_ping(0)

    def place(self, stream: int, target: memoryview) -> None:
        raise NotImplementedError("aioquic's connection does not place stream data")

    def live(self) -> Container[int]:
        """A sent stream leaves aioquic's table once the peer acknowledged all of it."""
        return self.quic._streams

    def next_event(self) -> Event | None:
        while (ev := self.quic.next_event()) is not None:
            if isinstance(ev, events.StreamDataReceived):
                return Received(ev.stream_id, ev.data, ev.end_stream)
            if isinstance(ev, events.HandshakeCompleted):
                return Handshaken(bool(ev.session_resumed), bool(ev.early_data_accepted))
            if isinstance(ev, events.ConnectionTerminated):
                idle = ev.error_code == QuicErrorCode.INTERNAL_ERROR and ev.reason_phrase == "Idle timeout"
                return Closed(ev.error_code, ev.reason_phrase, idle)
        return None

    def close(self, code: int = NO_ERROR, reason: str = "") -> None:
        self.quic.close(error_code=code, reason_phrase=reason)

    # ---- state and identity -----------------------------------------------------------------------------
    def took_nothing(self) -> bool:
        return self.quic._state is QuicConnectionState.FIRSTFLIGHT

    def ended(self) -> bool:
        """aioquic says ``ConnectionTerminated`` only once its closing period is over; this, from its start."""
        return self.quic._state in _ENDED

    def end_reason(self) -> str:
        ev = self.quic._close_event
        return close_reason(ev.error_code, ev.reason_phrase) if ev is not None else "closed"

    def free(self) -> None:
        """aioquic's connection refers to itself from its parts (bound methods as the callbacks of its TLS
        context, loss recovery, packet protection and frame handlers), which only the cyclic collector would
        free; dropping its attributes and those of its parts frees it at once."""
        quic = self.quic
        for part in list(vars(quic).values()):
            for value in part.values() if isinstance(part, dict) else part if isinstance(part, list | tuple) else [part]:
                inner = getattr(value, "__dict__", None)  # a part that calls back into the connection
                if isinstance(inner, dict) and any(getattr(v, "__self__", None) is quic for v in inner.values()):
                    inner.clear()
        quic.__dict__.clear()

    def demux_token(self) -> int | None:
        return None

    def peer_address(self) -> Any:
        return self.quic.get_peer_address()

    def host_cids(self) -> list[bytes]:
        quic = self.quic
        return [c.cid for c in quic._host_cids] + [quic.host_cid]

    def peer_identity(self) -> tuple[Any, list[Any]]:
        return self.quic.tls._peer_certificate, self.quic.tls._peer_certificate_chain

    def session_resumed(self) -> bool:
        return bool(self.quic.tls.session_resumed)

    def skip_client_certificate(self) -> None:
        self.quic.tls._request_client_certificate = False

    def rtt(self) -> float | None:
        loss = self.quic._loss
        return float(loss._rtt_smoothed) if loss._rtt_initialized else None

    def bandwidth(self) -> float | None:
        bw = getattr(self.quic._loss._cc, "bandwidth", None)
        return float(bw) if bw else None

    def describe(self) -> str:
        loss = self.quic._loss
        return f"{loss._cc.get_log_data()}, srtt {loss._rtt_smoothed:.5f} s"
