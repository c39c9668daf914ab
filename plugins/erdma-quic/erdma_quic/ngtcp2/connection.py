"""One QUIC connection on the compiled engine, sans-IO: ``receive`` datagrams, ``datagrams_to_send``,
``handle_timer`` at ``get_timer``, ``send`` whole messages, ``next_event`` for what happened (``Handshaken``,
``Message``, ``Acked``, ``Closed``). Time is an argument (seconds, any monotonic origin); nothing here touches a
socket except ``flush_to`` / ``receive_from``, the batch I/O of a driver that owns one UDP socket per peer.

A message handed to ``send`` is not copied: the connection keeps a reference to the caller's buffer until the
peer has acknowledged all of it (``Acked``), and QUIC reads it from there into packets. A received message
arrives whole, as a view of the engine's buffer (not copied), or, with ``Config.head``, its head first
(``Head``) so that the caller can give the rest a place of its own (``place``: the engine writes the bytes
there as they are decrypted, and says ``Placed``). Messages go to ``channels`` long-lived streams in
turn, each prefixed by its length (see shim.c for why not a stream each); a lost packet holds up only its own
channel. ``Ticket``: the listener gave the dialler a session ticket (``Config.ticket`` resumes with it).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

from erdma_core.sdk import PluginError

INSTALL = ("the compiled QUIC engine is not built: install ngtcp2's and GnuTLS's headers "
           "(apt-get install libngtcp2-dev libngtcp2-crypto-gnutls-dev libgnutls28-dev pkg-config gcc), "
           "then reinstall erdma-quic")
CC = {"reno": 0, "cubic": 1, "bbr": 2, "bbr2": 3}
BATCH = 64  # datagrams per call into the engine
HANDSHAKE_BATCH = 4  # ... before the handshake is done (a flight of the handshake is a few datagrams)
MAX_FLUSH = 1024  # datagrams written per datagrams_to_send / flush_to at most (the rest at the next)
RUN_POOL = 32  # released run buffers a connection keeps for its next batches
RX_STRIDE = 65536  # bytes a received datagram may take (a message UDP GRO coalesced, too)
GRO_SEGMENTS = 64  # the most datagrams the kernel coalesces into one message (UDP_MAX_SEGMENTS)
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
    tickets: Tickets | None = None  # listener: issue session tickets and take resumption and 0-RTT data
    ticket: bytes | None = None  # dialler: resume with this ticket (a ``Ticket`` event's) and send 0-RTT data
    demux: Demux | None = None  # the endpoint's table the connection keeps its connection ids in
    token: int = 0  # what ``Demux.receive`` reports for this connection
    head: int = 0  # a received message longer than this gives its first ``head`` bytes as ``Head`` (0: never)
    place_from: int = 0  # ... if it is at least this long


class Tickets:
    """A listener's session-ticket keys and its record of 0-RTT first flights (each one's early data is
    taken once, for as long as a ticket lives): one per endpoint, shared by the connections it accepts, used
    from one thread at a time. A ticket from another ``Tickets`` (another process) resumes nothing: that
    connection is a full handshake."""

    def __init__(self) -> None:
        ffi, lib = require()
        handle = lib.eq_tickets_new()
        if handle == ffi.NULL:
            raise MemoryError("QUIC engine: no memory for session-ticket keys")
        self.handle = ffi.gc(handle, lib.eq_tickets_free)


class Demux:
    """An endpoint's table from connection ids to its connections (each keeps its own ids in it as ngtcp2
    issues and retires them), and the receive fast path over it: ``receive`` reads a batch of datagrams
    from the socket and hands each one to a known connection straight to it, in C; the caller routes the
    rest (new connections, handshakes, unknown ids) and services the connections it is told were touched."""

    def __init__(self) -> None:
        ffi, lib = require()
        handle = lib.eq_demux_new()
        if handle == ffi.NULL:
            raise MemoryError("QUIC engine: no memory for the connection-id table")
        self.handle = ffi.gc(handle, lib.eq_demux_free)
        self._ffi, self._lib = ffi, lib
        self.buf = ffi.new("uint8_t[]", BATCH * RX_STRIDE)
        self.view = ffi.buffer(self.buf)  # a slice of it is a copy, as bytes
        cap = BATCH * GRO_SEGMENTS
        self._arrays = (ffi.new("int64_t[]", cap), ffi.new("size_t[]", cap), ffi.new("size_t[]", cap),
                        ffi.new("char[]", 46 * cap), ffi.new("int[]", cap))
        self._out = out = ffi.new("eq_recv_out *")
        out.touched, out.others, out.olens, out.hosts, out.ports = self._arrays
        out.cap = cap

    @property
    def coalesced(self) -> int:
        """Datagrams read so far that came coalesced with others in one message (UDP GRO)."""
        return int(self._out.coalesced)

    def receive(self, fd: int, now: float) -> tuple[int, list[int], list[tuple[bytes, tuple[str, int]]]]:
        """Read what waits on ``fd`` (one batch; where the socket asked for UDP GRO, a coalesced message is
        split into its datagrams): returns how many datagrams (0: none waiting; -errno on an error), the
        tokens of the connections that took some, and the others with their senders, as bytes (handshakes,
        new connections, unknown ids: few)."""
        out, ffi = self._out, self._ffi
        got = self._lib.eq_demux_recv(self.handle, fd, self.buf, RX_STRIDE, BATCH, _ns(now), out)
        if got <= 0:
            return got, [], []
        touched = [int(out.touched[i]) for i in range(out.ntouched)]
        others = []
        for k in range(out.nothers):
            at = out.others[k]
            others.append((self.view[at:at + out.olens[k]], (ffi.string(out.hosts + 46 * k).decode(), int(out.ports[k]))))
        return got, touched, others


class Run:
    """Datagrams the engine wrote for one address, where it wrote them (no copy): ``count`` of them, the i-th
    at ``i * stride`` in ``blob``, ``lens[i]`` bytes long (a socket sends them with one ``eq_sendmmsg``).
    ``release`` gives the memory back to the connection for its next batch: call it once they are sent and
    use the run no more (a run never released is freed by the collector)."""

    __slots__ = ("_pool", "_view", "blob", "count", "lens", "stride")

    def __init__(self, blob: Any, stride: int, lens: Any, count: int, pool: list[Any], view: Any) -> None:
        self.blob, self.stride, self.lens, self.count = blob, stride, lens, count
        self._pool, self._view = pool, view

    def datagrams(self) -> list[bytes]:
        view, step = self._view, self.stride
        return [view[i * step:i * step + self.lens[i]] for i in range(self.count)]

    def release(self) -> None:
        if self._pool is not None and len(self._pool) < RUN_POOL:
            self._pool.append((self.blob, self.lens, self._view))
        self._pool = None


@attrs.frozen
class Handshaken:
    """The handshake completed; the peer's chain checked against the CA (``peer_certificate`` names it)."""


@attrs.frozen
class Message:
    """A whole message, in the engine's own buffer (not copied; freed once nothing refers to ``data``)."""

    data: memoryview
    stream: int = -1  # the QUIC stream it came on


@attrs.frozen
class Head:
    """The first ``Config.head`` bytes of a longer message on ``stream`` (its ``seq``-th there): ``place`` may
    give the rest a buffer; else the rest comes as a ``Message``."""

    data: bytes
    stream: int
    seq: int


@attrs.frozen
class Placed:
    """The rest of the message ``place`` gave a buffer to is all there (``length`` bytes)."""

    stream: int
    length: int


@attrs.frozen
class Ticket:
    """Dialler: the listener gave a session ticket; ``Config.ticket`` of the next connection to it resumes
    the session and sends its first flight as 0-RTT data."""

    data: bytes


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


Event = Handshaken | Message | Acked | Closed | Ticket | Head | Placed
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
        if config.tickets is not None:
            self._keep.append(config.tickets.handle)  # the keys outlive every connection that uses them
            cfg.tickets = config.tickets.handle
        if config.demux is not None:
            # the engine counts the connection's reference to the table: Python's collector may free them in any order
            cfg.demux, cfg.token = config.demux.handle, config.token
        if config.ticket is not None:
            self._keep.append(ffi.from_buffer(config.ticket))
            cfg.ticket, cfg.ticket_len = self._keep[-1], len(config.ticket)
        cfg.head, cfg.place_from = config.head, config.place_from
        cfg.idle_timeout = int(config.idle_timeout * NS)
        cfg.handshake_timeout = int(config.handshake_timeout * NS)
        err = ffi.new("char[256]")
        handle = make(self._lib, cfg, err)
        if handle == ffi.NULL:
            raise ConnectionError(f"QUIC engine: {ffi.string(err).decode(errors='replace')}")
        self._c = ffi.gc(handle, self._lib.eq_free)
        self.datagram = config.datagram
        self._buffer: Any = None  # ``_out``'s, made on first use
        self._runs: list[tuple[Any, Any, Any]] = []  # buffers of released runs (``runs``)
        self._lens = ffi.new("size_t[]", BATCH)
        self._event = ffi.new("eq_event *")
        self._sending: dict[int, Any] = {}  # handle -> the caller's buffer, alive until Acked
        # stream -> the buffer the engine writes a placed message into, alive until it came whole; set after _c,
        # so that the collector frees the engine (which may be writing there) before these buffers
        self._placing: dict[int, Any] = {}
        self.head = config.head
        self._host, self._port = ffi.new("char[46]"), ffi.new("int *")
        self._from = ("", b"")  # the latest sender's host, and encoded for the shim

    @classmethod
    def dial(cls, config: Config, local: tuple[str, int], remote: tuple[str, int], now: float) -> Connection:
        def make(lib: Any, cfg: Any, err: Any) -> Any:
            return lib.eq_connect(cfg, local[0].encode(), local[1], remote[0].encode(), remote[1], _ns(now), err, 256)
        return cls(config, make)

    @classmethod
    def accept(cls, config: Config, local: tuple[str, int], remote: tuple[str, int], first: bytes,
               now: float, original_cid: bytes | None = None) -> Connection:
        """A connection from a client's first datagram (an Initial); ConnectionError when it is none.
        ``original_cid``: the destination id of the client's Initial before this endpoint answered it with a
        Retry, from the Retry token in ``first``, which the caller validated (None: no Retry came before)."""
        def make(lib: Any, cfg: Any, err: Any) -> Any:
            odcid = require()[0].NULL if original_cid is None else original_cid
            return lib.eq_accept(cfg, local[0].encode(), local[1], remote[0].encode(), remote[1], first, len(first),
                                 odcid, len(original_cid or b""), _ns(now), err, 256)
        return cls(config, make)

    def free(self) -> None:
        """Release the engine's memory now (the connection is unusable after)."""
        if self._c is not None:
            c, self._c = self._c, None
            self._ffi.gc(c, None)  # takes the destructor off c (in place; it returns None)
            self._lib.eq_free(c)
            self._sending.clear()
            self._placing.clear()
            self._runs.clear()
            self._buffer = None

    @property
    def _out(self) -> Any:
        """The buffer ``batches``, ``flush_to`` and ``receive_from`` write a batch of datagrams into: made on first
        use (a connection accepted from a stranger's Initial and refused never needs one)."""
        if self._buffer is None:
            self._buffer = self._ffi.new("uint8_t[]", BATCH * self.datagram)
        return self._buffer

    def _batch(self) -> int:
        """Datagrams a run may hold: a whole batch once the handshake is done; before, the few its flights take
        (an accepted stranger's connection holds a small buffer, not a whole batch's)."""
        return BATCH if self._lib.eq_handshake_done(self._c) else HANDSHAKE_BATCH

    # ---- datagrams and time ----------------------------------------------------------------------------
    def receive(self, datagrams: Iterable[bytes], now: float) -> None:
        for data in datagrams:
            self.receive_datagram(data, now)

    def receive_datagram(self, data: bytes, now: float, remote: tuple[str, int] | None = None) -> None:
        """One datagram, from ``remote`` (None: the peer's current address). A datagram from another address
        moves the connection there only once ngtcp2 has validated that path."""
        if remote is not None:
            if remote[0] != self._from[0]:
                self._from = (remote[0], remote[0].encode())
            self._lib.eq_read_from(self._c, data, len(data), self._from[1], remote[1], _ns(now))
            return
        self._lens[0] = len(data)
        self._lib.eq_read(self._c, data, len(data), self._lens, 1, _ns(now))

    def batches(self, now: float) -> list[tuple[tuple[str, int], list[bytes]]]:
        """What is due, as ``(address, datagrams)`` runs: almost always one run to the peer's address; a probe
        of a path the peer moved to goes to that path's address."""
        out: list[tuple[tuple[str, int], list[bytes]]] = []
        buf, step, total = self._ffi.buffer(self._out), self.datagram, 0
        # each call writes at most the controller's send quantum; the pacer lets the next go at once while it
        # is due within ngtcp2's pacing allowance (1 ms), which is also the poll's granularity
        while total < MAX_FLUSH and (n := self._lib.eq_write(self._c, self._out, step, self._lens, BATCH,
                                                              _ns(now))):
            self._lib.eq_destination(self._c, self._host, self._port)
            to = (self._ffi.string(self._host).decode(), int(self._port[0]))
            run = [buf[i * step:i * step + self._lens[i]] for i in range(n)]
            if out and out[-1][0] == to:
                out[-1][1].extend(run)
            else:
                out.append((to, run))
            total += n
        return out

    def runs(self, now: float) -> list[tuple[tuple[str, int], Run]]:
        """``batches`` as ``Run`` objects: each batch where the engine wrote it (buffers the runs give back
        with ``release`` are used again), no copy, no object per datagram."""
        out: list[tuple[tuple[str, int], Run]] = []
        ffi, lib, step, total, pool = self._ffi, self._lib, self.datagram, 0, self._runs
        batch = self._batch()
        while total < MAX_FLUSH:
            while pool and len(pool[-1][1]) < batch:  # made before the handshake: too small now
                pool.pop()
            if pool:
                blob, lens, view = pool.pop()
            else:
                blob, lens = ffi.new("uint8_t[]", batch * step), ffi.new("size_t[]", batch)
                view = ffi.buffer(blob)
            n = lib.eq_write(self._c, blob, step, lens, len(lens), _ns(now))
            if not n:
                pool.append((blob, lens, view))
                break
            lib.eq_destination(self._c, self._host, self._port)
            out.append(((ffi.string(self._host).decode(), int(self._port[0])), Run(blob, step, lens, n, pool, view)))
            total += n
        return out

    def datagrams_to_send(self, now: float) -> list[bytes]:
        """``batches``' datagrams, whatever their address (for a peer at one address)."""
        return [d for _, run in self.batches(now) for d in run]

    def get_timer(self) -> float | None:
        at = self._lib.eq_expiry(self._c)
        return None if at == _NEVER else at / NS

    def handle_timer(self, now: float) -> None:
        self._lib.eq_handle_expiry(self._c, _ns(now))

    # ---- messages ----------------------------------------------------------------------------------------
    def send(self, message: bytes | bytearray | memoryview, payload: bytes | bytearray | memoryview = b"") -> int:
        """Queue ``message`` (followed by ``payload``, as one message) whole, not copied: keep both unchanged
        until ``Acked``. Returns its handle."""
        head, body = self._ffi.from_buffer(message), self._ffi.from_buffer(_unviewed(payload))
        handle = self._lib.eq_send2(self._c, head, len(head), body, len(body))
        if handle < 0:
            raise ConnectionError("QUIC engine: the connection has ended; nothing more can be sent on it")
        self._sending[handle] = (head, body)
        return int(handle)

    def place(self, head: Head, target: memoryview) -> bool:
        """The rest of ``head``'s message (all but its head: exactly ``len(target)`` bytes) goes into ``target``,
        which must stay until ``Placed`` (or the connection's end). False: that message has come whole already,
        and its ``Message`` (the rest) follows."""
        if self._c is None:
            return False
        buf = self._ffi.from_buffer("uint8_t[]", _unviewed(target), require_writable=True)
        if self._lib.eq_place(self._c, head.stream, head.seq, buf, len(buf)) != 0:
            return False
        self._placing[head.stream] = (buf, target)
        return True

    def next_event(self) -> Event | None:
        ev = self._event
        if not self._lib.eq_next_event(self._c, ev):
            return None
        kind = ev.kind
        lib = self._lib
        if kind == lib.EQ_MESSAGE:
            owned = self._ffi.gc(ev.data, lib.eq_free_message)  # the buffer keeps it, the view keeps the buffer
            data = memoryview(self._ffi.buffer(owned, ev.len))
            if ev.origin:  # its head came before (``Head``) and was not placed
                self._placing.pop(ev.handle, None)
                data = data[self.head:]
            return Message(data, int(ev.handle))
        if kind == lib.EQ_HEAD:
            head = bytes(self._ffi.buffer(ev.data, ev.len))
            lib.eq_free_message(ev.data)
            return Head(head, int(ev.handle), int(ev.code))
        if kind == lib.EQ_PLACED:
            self._placing.pop(ev.handle, None)
            return Placed(int(ev.handle), int(ev.len))
        if kind == lib.EQ_ACKED:
            self._sending.pop(ev.handle, None)
            return Acked(int(ev.handle))
        if kind == lib.EQ_HANDSHAKE:
            return Handshaken()
        if kind == lib.EQ_TICKET:
            ticket = bytes(self._ffi.buffer(ev.data, ev.len))
            lib.eq_free_message(ev.data)
            return Ticket(ticket)
        self._sending.clear()
        return Closed(_ORIGINS[ev.origin], int(ev.code), self._ffi.string(ev.reason).decode(errors="replace"))

    def close(self, code: int, reason: str, now: float) -> None:
        """End the connection; the peer learns ``code`` and ``reason`` from the next ``datagrams_to_send``."""
        self._lib.eq_close(self._c, code, reason.encode()[:200], _ns(now))

    @property
    def remote(self) -> tuple[str, int]:
        """The peer's address the connection now uses."""
        self._lib.eq_remote(self._c, self._host, self._port)
        return self._ffi.string(self._host).decode(), int(self._port[0])

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
    def ended(self) -> bool:
        """The connection is over (``Closed`` was or is about to be said); at most its close is still to go."""
        return bool(self._lib.eq_ended(self._c))

    @property
    def handshake_done(self) -> bool:
        return bool(self._lib.eq_handshake_done(self._c))

    @property
    def resumed(self) -> bool:
        """The TLS session was resumed from a ticket (the dialler's certificate is the one it proved then)."""
        return bool(self._lib.eq_resumed(self._c))

    @property
    def early_data_accepted(self) -> bool:
        """The listener took the dialler's 0-RTT data (dialler: known once the handshake is done)."""
        return bool(self._lib.eq_early_data_accepted(self._c))

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
    def flush_to(self, sock: socket.socket, now: float, gso: bool = False) -> int:
        """Write what is due and send it to ``remote`` with ``sendmmsg`` (``gso``: runs of full-size datagrams
        as one message each, UDP GSO); returns datagrams sent."""
        sent = 0
        send = self._lib.eq_sendmmsg_gso if gso else self._lib.eq_sendmmsg
        while sent < MAX_FLUSH and (n := self._lib.eq_write(self._c, self._out, self.datagram, self._lens, BATCH,
                                                             _ns(now))):
            self._lib.eq_destination(self._c, self._host, self._port)
            done = send(sock.fileno(), self._out, self.datagram, self._lens, n, self._host, self._port[0])
            if done < 0:
                raise OSError(-done, f"sendmmsg to {self._ffi.string(self._host).decode()}:{self._port[0]}")
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
    # rounded, not truncated: a time that get_timer gave (ns / NS) comes back as the same ns, so the timer it
    # names is due at it (truncating could land 1 ns early, and the timer would never be due)
    return round(now * NS)


def _unviewed(buf: Any) -> Any:
    """What cffi pins for the engine, never a memoryview: a memoryview that the collector clears while it
    has a buffer exported (a pinned message in a dropped connection's cycle) loses its managed buffer, and
    releasing that export then crashes CPython. A numpy view of the same memory holds no export."""
    return np.frombuffer(buf, np.uint8) if isinstance(buf, memoryview) else buf
