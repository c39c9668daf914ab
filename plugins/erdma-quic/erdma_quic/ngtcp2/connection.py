"""One QUIC connection on the compiled engine, sans-IO: ``receive`` datagrams, ``datagrams_to_send``,
``handle_timer`` at ``get_timer``, ``send`` whole messages, ``next_event`` for what happened (``Handshaken``,
``Message``, ``Acked``, ``Closed``). Time is an argument (seconds, any monotonic origin); nothing here touches a
socket except ``flush_to`` / ``receive_from``, the batch I/O of a driver that owns one UDP socket per peer.

A message handed to ``send`` is not copied: the connection keeps a reference to the caller's buffer until the
peer has acknowledged all of it (``Acked``), and QUIC reads it from there into packets. A received message
arrives whole, as ``bytes``. Messages go to ``channels`` long-lived streams in turn, each prefixed by its
length (see shim.c for why not a stream each); a lost packet holds up only its own channel.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

import attrs

from erdma_core.errors import PluginError

INSTALL = ("the compiled QUIC engine is not built: install ngtcp2's and GnuTLS's headers "
           "(apt-get install libngtcp2-dev libngtcp2-crypto-gnutls-dev libgnutls28-dev pkg-config gcc), "
           "then reinstall erdma-quic")
CC = {"reno": 0, "cubic": 1, "bbr": 2, "bbr2": 3}
BATCH = 64  # datagrams per call into the engine
MAX_FLUSH = 1024  # datagrams written per datagrams_to_send / flush_to at most (the rest at the next)
NS = 1_000_000_000
_NEVER = 2**64 - 1


def loaded() -> tuple[Any, Any] | None:
    """The shim's ``(ffi, lib)`` where it was built, else None."""
    try:
        from ._shim import ffi, lib  # type: ignore[import-not-found]
    except ImportError:
        return None
    return ffi, lib


def require() -> tuple[Any, Any]:
    """The shim's ``(ffi, lib)``; PluginError naming what to install where it was not built."""
    shim = loaded()
    if shim is None:
        raise PluginError(INSTALL)
    return shim


@attrs.frozen(kw_only=True)
class Config:
    """What both ends of a connection are set up with. ``ca_pem`` None: the peer's chain is not checked."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes | None
    datagram: int = 1452
    cc: str = attrs.field(default="bbr2", validator=attrs.validators.in_(CC))
    window: int = 16 << 20  # flow control per connection, bytes
    stream_window: int = 0  # per message; 0: ``window``
    server_name: str | None = None  # dialler: the name the listener's certificate must carry
    priority: str | None = None  # GnuTLS priority string; None: TLS 1.3 with GnuTLS's default ciphers
    check_client: bool = True  # listener: TLS checks the dialler's chain (False: the caller does, to say why)
    idle_timeout: float = 30.0
    handshake_timeout: float = 10.0
    channels: int = 8  # streams this end sends messages on, in turn (1..64)


@attrs.frozen
class Handshaken:
    """The handshake completed; the peer's chain checked against the CA (``peer_certificate`` names it)."""


@attrs.frozen
class Message:
    data: bytes
    stream: int = -1  # the QUIC stream it came on


@attrs.frozen
class Acked:
    """The peer acknowledged all of the message ``send`` returned ``handle`` for; its buffer is released."""

    handle: int


@attrs.frozen
class Closed:
    """The connection ended: ``origin`` is "us", "peer", "idle", "tls" or "error"."""

    origin: str
    code: int
    reason: str


Event = Handshaken | Message | Acked | Closed
_ORIGINS = ("us", "peer", "idle", "tls", "error")


class Connection:
    """See the module's docstring. Made by ``dial`` or ``accept``; ``free`` (or garbage collection) releases
    the engine's memory."""

    def __init__(self, config: Config, make: Any) -> None:
        self._ffi, self._lib = require()
        ffi = self._ffi
        self._keep = [ffi.from_buffer(config.cert_pem), ffi.from_buffer(config.key_pem)]
        cfg = ffi.new("eq_config *")
        cfg.cert_pem, cfg.cert_len = self._keep[0], len(config.cert_pem)
        cfg.key_pem, cfg.key_len = self._keep[1], len(config.key_pem)
        if config.ca_pem is not None:
            self._keep.append(ffi.from_buffer(config.ca_pem))
            cfg.ca_pem, cfg.ca_len = self._keep[-1], len(config.ca_pem)
        cfg.datagram, cfg.cc, cfg.window, cfg.channels = config.datagram, CC[config.cc], config.window, config.channels
        cfg.stream_window = config.stream_window or config.window
        cfg.check_client = int(config.check_client)
        for field in ("server_name", "priority"):
            text = getattr(config, field)
            if text is not None:
                self._keep.append(ffi.new("char[]", text.encode()))
                setattr(cfg, field, self._keep[-1])
        cfg.idle_timeout = int(config.idle_timeout * NS)
        cfg.handshake_timeout = int(config.handshake_timeout * NS)
        err = ffi.new("char[256]")
        handle = make(self._lib, cfg, err)
        if handle == ffi.NULL:
            raise ConnectionError(f"QUIC engine: {ffi.string(err).decode(errors='replace')}")
        self._c = ffi.gc(handle, self._lib.eq_free)
        self.datagram = config.datagram
        self._out = ffi.new("uint8_t[]", BATCH * config.datagram)
        self._lens = ffi.new("size_t[]", BATCH)
        self._event = ffi.new("eq_event *")
        self._sending: dict[int, Any] = {}  # handle -> the caller's buffer, alive until Acked
        self.remote: tuple[str, int] = ("", 0)

    @classmethod
    def dial(cls, config: Config, local: tuple[str, int], remote: tuple[str, int], now: float) -> Connection:
        def make(lib: Any, cfg: Any, err: Any) -> Any:
            return lib.eq_connect(cfg, local[0].encode(), local[1], remote[0].encode(), remote[1], _ns(now), err, 256)
        conn = cls(config, make)
        conn.remote = remote
        return conn

    @classmethod
    def accept(cls, config: Config, local: tuple[str, int], remote: tuple[str, int], first: bytes,
               now: float) -> Connection:
        """A connection from a client's first datagram (an Initial); ConnectionError when it is none."""
        def make(lib: Any, cfg: Any, err: Any) -> Any:
            return lib.eq_accept(cfg, local[0].encode(), local[1], remote[0].encode(), remote[1], first, len(first),
                                 _ns(now), err, 256)
        conn = cls(config, make)
        conn.remote = remote
        return conn

    def free(self) -> None:
        """Release the engine's memory now (the connection is unusable after)."""
        if self._c is not None:
            self._lib.eq_free(self._ffi.gc(self._c, None))
            self._c = None
            self._sending.clear()

    # ---- datagrams and time ----------------------------------------------------------------------------
    def receive(self, datagrams: Iterable[bytes], now: float) -> None:
        for data in datagrams:
            self.receive_datagram(data, now)

    def receive_datagram(self, data: bytes, now: float) -> None:
        self._lens[0] = len(data)
        self._lib.eq_read(self._c, data, len(data), self._lens, 1, _ns(now))

    def datagrams_to_send(self, now: float) -> list[bytes]:
        out: list[bytes] = []
        buf, step = self._ffi.buffer(self._out), self.datagram
        # each call writes at most the controller's send quantum; the pacer lets the next go at once while it
        # is due within ngtcp2's pacing allowance (1 ms), which is also the poll's granularity
        while len(out) < MAX_FLUSH and (n := self._lib.eq_write(self._c, self._out, step, self._lens, BATCH,
                                                                 _ns(now))):
            out.extend(buf[i * step:i * step + self._lens[i]] for i in range(n))
        return out

    def get_timer(self) -> float | None:
        at = self._lib.eq_expiry(self._c)
        return None if at == _NEVER else at / NS

    def handle_timer(self, now: float) -> None:
        self._lib.eq_handle_expiry(self._c, _ns(now))

    # ---- messages ----------------------------------------------------------------------------------------
    def send(self, message: bytes | bytearray | memoryview, payload: bytes | bytearray | memoryview = b"") -> int:
        """Queue ``message`` (followed by ``payload``, as one message) whole, not copied: keep both unchanged
        until ``Acked``. Returns its handle."""
        head, body = self._ffi.from_buffer(message), self._ffi.from_buffer(payload)
        handle = self._lib.eq_send2(self._c, head, len(head), body, len(body))
        if handle < 0:
            raise ConnectionError("QUIC engine: the connection has ended; nothing more can be sent on it")
        self._sending[handle] = (head, body)
        return int(handle)

    def next_event(self) -> Event | None:
        ev = self._event
        if not self._lib.eq_next_event(self._c, ev):
            return None
        kind = ev.kind
        lib = self._lib
        if kind == lib.EQ_MESSAGE:
            data = bytes(self._ffi.buffer(ev.data, ev.len))
            lib.eq_free_message(ev.data)
            return Message(data, int(ev.handle))
        if kind == lib.EQ_ACKED:
            self._sending.pop(ev.handle, None)
            return Acked(int(ev.handle))
        if kind == lib.EQ_HANDSHAKE:
            return Handshaken()
        self._sending.clear()
        return Closed(_ORIGINS[ev.origin], int(ev.code), self._ffi.string(ev.reason).decode(errors="replace"))

    def close(self, code: int, reason: str, now: float) -> None:
        """End the connection; the peer learns ``code`` and ``reason`` from the next ``datagrams_to_send``."""
        self._lib.eq_close(self._c, code, reason.encode()[:200], _ns(now))

    def set_remote(self, remote: tuple[str, int]) -> None:
        if self._lib.eq_set_remote(self._c, remote[0].encode(), remote[1]) != 0:
            raise ValueError(f"QUIC engine: {remote[0]!r} is not an IPv4 or IPv6 address")
        self.remote = remote

    # ---- state ----------------------------------------------------------------------------------------
    def peer_certificate(self) -> bytes | None:
        """The peer's certificate (DER) once the handshake is done; None when it presented none."""
        der = self._ffi.new("const uint8_t **")
        n = self._lib.eq_peer_certificate(self._c, der)
        return bytes(self._ffi.buffer(der[0], n)) if n else None

    def connection_ids(self) -> list[bytes]:
        """This end's connection ids (8 bytes each): a datagram to this connection carries one of them."""
        ids = self._ffi.new("uint8_t[]", 8 * 16)
        n = self._lib.eq_scids(self._c, ids, 16)
        raw = bytes(self._ffi.buffer(ids, 8 * n))
        return [raw[i:i + 8] for i in range(0, len(raw), 8)]

    @property
    def delivery_rate(self) -> float | None:
        """Bytes per second the congestion controller measured; None before it has."""
        rate = self._lib.eq_delivery_rate(self._c)
        return float(rate) if rate else None

    @property
    def handshake_done(self) -> bool:
        return bool(self._lib.eq_handshake_done(self._c))

    @property
    def queued(self) -> int:
        """Messages sent and not yet acknowledged."""
        return int(self._lib.eq_queued(self._c))

    @property
    def cwnd(self) -> int:
        return int(self._lib.eq_cwnd(self._c))

    @property
    def rtt(self) -> float:
        return self._lib.eq_rtt(self._c) / NS

    # ---- batch I/O (a driver with one UDP socket per peer) ------------------------------------------------
    def flush_to(self, sock: socket.socket, now: float) -> int:
        """Write what is due and send it to ``remote`` with ``sendmmsg``; returns datagrams sent."""
        sent, host = 0, self.remote[0].encode()
        while sent < MAX_FLUSH and (n := self._lib.eq_write(self._c, self._out, self.datagram, self._lens, BATCH,
                                                             _ns(now))):
            done = self._lib.eq_sendmmsg(sock.fileno(), self._out, self.datagram, self._lens, n, host, self.remote[1])
            if done < 0:
                raise OSError(-done, f"sendmmsg to {self.remote}")
            sent += n  # a full socket buffer drops the rest, as a wire would; QUIC sends them again
        return sent

    def receive_from(self, sock: socket.socket, now: float) -> int:
        """Read every datagram waiting on ``sock`` (``recvmmsg``) into this connection; returns how many."""
        got = 0
        hosts, ports = self._ffi.new("char[]", 46 * BATCH), self._ffi.new("int[]", BATCH)
        while (n := self._lib.eq_recvmmsg(sock.fileno(), self._out, self.datagram, self._lens, BATCH, hosts,
                                          ports)) > 0:
            self._lib.eq_read(self._c, self._out, self.datagram, self._lens, n, _ns(now))
            got += n
            if n < BATCH:
                break
        if n < 0:
            raise OSError(-n, "recvmmsg")
        return got


def _ns(now: float) -> int:
    return int(now * NS)
