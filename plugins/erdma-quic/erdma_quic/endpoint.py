"""The asyncio side: one UDP socket for every QUIC connection of a rank, an event loop in a thread of its
own, datagrams routed to connections by connection id, timers, and ICMP errors turned into lost peers.

Everything protocol-shaped lives in aioquic's ``QuicConnection`` (sans-IO) and in ``streams``; this module
only moves datagrams and time between them and the socket. Other threads reach the loop through ``call``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, Protocol

from aioquic.quic.connection import QuicConnection

log = logging.getLogger("erdma.quic")
_IP_RECVERR = 11
_IP_MTU = 14
_RECV_BATCH = 256  # datagrams read per wake-up before connections get to answer
_CID_LENGTH = 8
_UDP_SEGMENT = 103  # linux/udp.h: GSO segment size for one sendmsg
_GSO_MAX = 65000  # one GSO send is one IP packet before segmentation: at most 64 KiB


class Session(Protocol):
    """What the endpoint drives: a connection plus what to do with its events."""

    conn: QuicConnection
    last_rx: float

    def on_events(self) -> None: ...

    def after_io(self) -> bool: ...

    def on_unreachable(self) -> None: ...


def path_mtu(addr: tuple[str, int]) -> int:
    """The MTU the kernel knows for the route to ``addr`` (the interface's, until PMTU learns more)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(addr)
        return int(s.getsockopt(socket.IPPROTO_IP, _IP_MTU))
    except OSError:
        return 1500
    finally:
        s.close()


def datagram_size(addr: tuple[str, int], configured: int) -> int:
    """Largest QUIC datagram for ``addr``: the configured size, or (0) the path MTU less IPv4 and UDP
    headers, capped at 16000 bytes (aioquic writes a STREAM frame's length in two bytes)."""
    if configured:
        return configured
    return max(1200, min(path_mtu(addr) - 28, 16000))


class Endpoint:
    def __init__(self, sock: socket.socket, accept: Callable[[bytes, tuple[str, int]], Session | None],
                 name: str, gso: bool = False) -> None:
        """``accept(dcid, addr)`` makes a session for a new incoming connection (None: ignore it)."""
        self.sock = sock
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.IPPROTO_IP, _IP_RECVERR, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
        self.accept = accept
        self.loop = asyncio.new_event_loop()
        self.sessions: dict[bytes, Session] = {}  # by any connection id the session answers to
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._dirty: dict[int, Session] = {}
        self.send_drops = 0
        self.gso = gso and hasattr(socket, "SOL_UDP")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- thread bridge -------------------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.add_reader(self.sock.fileno(), self._readable)
        self.loop.run_forever()
        self.loop.remove_reader(self.sock.fileno())
        self.loop.close()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread soon (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed: the transport is shutting down
            pass

    def run_sync(self, fn: Callable[..., Any], *args: Any, timeout: float = 5.0) -> Any:
        """Run ``fn(*args)`` on the loop thread and return its result (from another thread)."""
        if threading.current_thread() is self._thread:
            return fn(*args)

        async def wrapped() -> Any:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.call(self.loop.stop)
        self._thread.join(5.0)
        self.sock.close()

    @property
    def now(self) -> float:
        return self.loop.time()

    # ---- connections ---------------------------------------------------------------------------------
    def add(self, session: Session) -> None:
        for cid in _host_cids(session.conn):
            self.sessions[cid] = session

    def touch(self, session: Session) -> None:
        """Let a session's connection send what it has, and re-arm its timer (on the loop thread)."""
        self._dirty[id(session)] = session
        if len(self._dirty) == 1:
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, {}
        for session in dirty.values():
            self._service(session)

    def _service(self, session: Session) -> None:
        conn = session.conn
        session.on_events()
        session.after_io()
        while True:
            self._transmit(conn)
            # building packets retires acknowledged streams, which may open the window: hand QUIC more now,
            # or nothing would ask again until the next timer
            if not session.after_io():
                break
        for cid in _host_cids(conn):
            self.sessions.setdefault(cid, session)
        key = id(session)
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        at = conn.get_timer()
        if at is not None:
            self._timers[key] = self.loop.call_at(at, self._on_timer, session)

    def _transmit(self, conn: QuicConnection) -> None:
        out = conn.datagrams_to_send(now=self.now)
        if not self.gso or len(out) < 2:
            for data, addr in out:
                self._send(data, addr)
            return
        # UDP GSO: runs of equal-size datagrams to one address (the last may be shorter) in one sendmsg
        i = 0
        while i < len(out):
            data, addr = out[i]
            size, j, total = len(data), i + 1, len(data)
            while (j < len(out) and out[j][1] == addr and len(out[j][0]) <= size and total + len(out[j][0]) <= _GSO_MAX
                   and len(out[j - 1][0]) == size):
                total += len(out[j][0])
                j += 1
            if j - i == 1:
                self._send(data, addr)
            else:
                self._send_gso(b"".join(d for d, _ in out[i:j]), size, addr, out[i:j])
            i = j

    def _send(self, data: bytes, addr: Any) -> None:
        try:
            self.sock.sendto(data, addr)
        except BlockingIOError:
            self.send_drops += 1  # QUIC's loss recovery resends it
        except OSError as exc:
            if exc.errno != errno.ECONNREFUSED:
                log.debug("sendto %s: %s", addr, exc)

    def _send_gso(self, blob: bytes, size: int, addr: Any, parts: list[tuple[bytes, Any]]) -> None:
        try:
            self.sock.sendmsg([blob], [(socket.SOL_UDP, _UDP_SEGMENT, struct.pack("=H", size))], 0, addr)
        except BlockingIOError:
            self.send_drops += len(parts)
        except OSError as exc:
            if exc.errno == errno.ECONNREFUSED:
                return
            log.info("UDP GSO unavailable (%s); sending datagrams one by one", exc)
            self.gso = False
            for data, a in parts:
                self._send(data, a)

    def _on_timer(self, session: Session) -> None:
        self._timers.pop(id(session), None)
        session.conn.handle_timer(now=self.now)
        self._service(session)

    def forget(self, session: Session) -> None:
        for cid in [c for c, s in self.sessions.items() if s is session]:
            del self.sessions[cid]
        old = self._timers.pop(id(session), None)
        if old is not None:
            old.cancel()

    # ---- socket --------------------------------------------------------------------------------------
    def _readable(self) -> None:
        touched: dict[int, Session] = {}
        for _ in range(_RECV_BATCH):
            try:
                data, addr = self.sock.recvfrom(65536)
            except BlockingIOError:
                break
            except OSError:
                self._read_errors()
                continue
            session = self._route(data, addr)
            if session is not None:
                session.last_rx = self.now
                session.conn.receive_datagram(data, addr, now=self.now)
                touched[id(session)] = session
        for session in touched.values():
            self._service(session)

    def _route(self, data: bytes, addr: tuple[str, int]) -> Session | None:
        if len(data) < 1 + _CID_LENGTH:
            return None
        if data[0] & 0x80:  # long header: version, then the destination connection id with its length
            if len(data) < 6 or len(data) < 6 + data[5]:
                return None
            dcid = bytes(data[6:6 + data[5]])
        else:
            dcid = bytes(data[1:1 + _CID_LENGTH])
        session = self.sessions.get(dcid)
        if session is None and data[0] & 0x80:
            session = self.accept(dcid, addr)
            if session is not None:
                self.sessions[dcid] = session
                self.add(session)
        return session

    def _read_errors(self) -> None:
        """Drain the socket's error queue: a session whose peer's port answered 'unreachable' hears of it."""
        while True:
            try:
                _, _, _, addr = self.sock.recvmsg(64, 512, socket.MSG_ERRQUEUE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            for session in {id(s): s for s in self.sessions.values()}.values():
                if session.conn.get_peer_address() == addr:
                    session.on_unreachable()


def _host_cids(conn: QuicConnection) -> list[bytes]:
    return [c.cid for c in conn._host_cids] + [conn.host_cid]
