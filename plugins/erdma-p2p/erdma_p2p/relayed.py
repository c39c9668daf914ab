"""The I/O adapter of a ``turn.TurnClient``: a UDP socket with a relay allocation, whose peers are reached
directly or through the TURN relay.

``RelayedSocket`` stands in for the data socket handed to the datagram transport (erdma-quic). What the relay
delivers comes back from ``recvfrom`` with the peer's address, as if it had come directly, but tagged (``Via``),
and every datagram sent to the address so tagged leaves for the relay server, framed for that peer
(ChannelData, or a Send indication until the channel is bound): a connection that reached this rank through
its relayed address is answered that way, and one that came directly, directly, though both come from one
address (a peer checking its candidates at once). The relay's own answers
(permissions, channels, refreshes) are consumed on the way, and the client's timers run on every call,
direct traffic's too (so the relay is still there when a path falls back to it): the transport's keepalives
keep them turning. Everything else is the real socket's (``fileno`` for the event loop, options, the error
queue).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

from .stun import StunError, exchange
from .turn import TurnClient, TurnError

PUNCH = b"\x00erdma-punch"  # the traversal's punch datagram (not a QUIC packet: the fixed bit is 0)
_UDP_SEGMENT = 103  # linux/udp.h: UDP_SEGMENT, the GSO segment size


class Via(tuple):  # type: ignore[type-arg]
    """A peer's address as ``recvfrom`` gives it for what came through the relay: equal to the plain address,
    but what is sent to it goes back through the relay. A QUIC connection keeps the address object of its
    first datagram, so each connection is answered the way it came, even when two come from one address (a
    peer's direct check and its check through the relay)."""

    __slots__ = ()


class RelayedSocket:
    """``direct`` False: ``sock`` reaches only the TURN server (``turn_tcp.TcpDatagrams``, TURN over TCP), so
    every peer is reached through the relay, and punches (which open this rank's own NAT) are not sent."""

    def __init__(self, sock: Any, client: TurnClient, server: tuple[str, int], direct: bool = True,
                 owner: bool = True) -> None:
        self.sock, self.client, self.server, self.direct = sock, client, server, direct
        self.owner = owner  # closing releases the allocation (False: a twin, ``twin``)
        self._lock = threading.Lock()  # the transport's loop thread and its punch thread both send
        self._errors: list[tuple[bytes, list[Any], int, tuple[str, int]]] = []
        self._due = client.timer  # when the client's timers next need running (not on every datagram)
        self._via: set[tuple[str, int]] = set()  # peers last heard from through the relay (its ICMP errors)

    def twin(self, sock: Any) -> RelayedSocket:
        """The same allocation on ``sock`` (a duplicate of this socket's descriptor, ``kept.Lease``), for a
        later set-up: closing the twin closes only ``sock``; the peers it answers through the relay, its lock
        and the relay's permissions and channels are this socket's."""
        twin = RelayedSocket(sock, self.client, self.server, self.direct, owner=False)
        twin._lock, twin._via = self._lock, self._via
        return twin

    @property
    def closed_at(self) -> float | None:
        """When a twin's socket was closed (``kept.Lease``); None while it is open."""
        return getattr(self.sock, "closed_at", None)

    def relayed(self, addr: tuple[str, int]) -> bool:
        """Whether ``addr`` is reached through the relay: a ``Via`` (the address a connection that came through
        it keeps). Not by the last datagram from that address: a peer's direct connection and its check through
        the relay come from one address."""
        return not self.direct or isinstance(addr, Via)

    def permit(self, host: str) -> None:
        """Let ``host`` reach this socket through the relayed address (a TURN permission)."""
        with self._lock:
            self.client.permit(host, time.monotonic())
            self._flush()

    # the real socket's
    def fileno(self) -> int:
        return self.sock.fileno()

    def setblocking(self, flag: bool) -> None:
        self.sock.setblocking(flag)

    def setsockopt(self, *args: Any) -> None:
        self.sock.setsockopt(*args)

    def getsockopt(self, *args: Any) -> Any:
        return self.sock.getsockopt(*args)

    def getsockname(self) -> Any:
        return self.sock.getsockname()

    def recvmsg(self, bufsize: int, ancbufsize: int = 0, flags: int = 0) -> Any:
        """The real socket's; an ICMP error from the relay server (its port closed: the relay is gone) stands
        for every peer reached through it, one per call, so the transport hears that each is unreachable."""
        if flags & socket.MSG_ERRQUEUE and self._errors:
            return self._errors.pop()
        got = self.sock.recvmsg(bufsize, ancbufsize, flags)
        if flags & socket.MSG_ERRQUEUE and tuple(got[3][:2]) == self.server:
            with self._lock:
                peers = [(p.host, p.port) for p in self.client.peers() if (p.host, p.port) in self._via]
            self._errors = [(got[0], got[1], got[2], p) for p in peers]
            if self._errors:
                return self._errors.pop()
        return got

    def close(self) -> None:
        if not self.owner:
            self.sock.close()
            return
        with self._lock:
            self.client.close(time.monotonic())
            self._flush()
        self.sock.close()

    # data, directly or through the relay
    def sendto(self, data: bytes | memoryview, addr: tuple[str, int]) -> int:
        # a punch opens this rank's own NAT, so it always goes direct (a QUIC packet's first byte is never 0)
        punch = len(data) > 0 and data[0] == 0 and bytes(data[:len(PUNCH)]) == PUNCH
        if punch and not self.direct:
            return len(data)  # no direct path to open
        if self.direct and (not isinstance(addr, Via) or punch):
            self._timers()
            return self.sock.sendto(data, addr)
        with self._lock:
            now = time.monotonic()
            self._tick(now)
            framed = self.client.wrap(data, addr[0], addr[1], now)
            self._flush()
        self.sock.sendto(framed, self.server)
        return len(data)

    def sendmsg(self, buffers: list[bytes], ancdata: list[tuple[int, int, bytes]], flags: int,
                addr: tuple[str, int]) -> int:
        """UDP GSO (one buffer cut into datagrams of the segment size in ``ancdata``): the real socket's for a
        direct peer; through the relay, datagram by datagram."""
        if self.direct and not isinstance(addr, Via):
            self._timers()
            return self.sock.sendmsg(buffers, ancdata, flags, addr)
        blob = b"".join(buffers)
        size = next((struct.unpack("=H", data)[0] for level, kind, data in ancdata if kind == _UDP_SEGMENT),
                    len(blob)) or len(blob)
        for i in range(0, len(blob), size):
            self.sendto(blob[i:i + size], addr)
        return len(blob)

    def recvfrom(self, size: int) -> tuple[bytes, tuple[str, int]]:
        while True:
            data, src = self.sock.recvfrom(max(size, 65536))  # BlockingIOError ends the caller's batch
            if src != self.server:
                self._via.discard(src)
                self._timers()
                return data, src  # not relayed (a peer that reached this socket directly)
            with self._lock:
                now = time.monotonic()
                got = self.client.on_datagram(data, now)
                if got is None:  # an answer of the relay's own: timers may have moved
                    self._due = self.client.timer
                self._tick(now)
                self._flush()
            if got is not None:
                peer = Via((got[1].host, got[1].port))
                self._via.add(peer)
                return got[0], peer

    def _timers(self) -> None:
        """On direct traffic too: the allocation, the permissions and the channels stay fresh while every peer
        is reached directly, so that the relay still works when a path falls back to it."""
        due = self._due
        if due is not None and time.monotonic() >= due:
            with self._lock:
                self._tick(time.monotonic())
                self._flush()

    def _tick(self, now: float) -> None:
        if self._due is not None and now >= self._due:
            self.client.on_timer(now)
            self._due = self.client.timer

    def _flush(self) -> None:
        out = self.client.outgoing()
        if out:  # new requests (a permission, a channel): their resend timers start now
            self._due = self.client.timer
        for datagram in out:
            try:
                self.sock.sendto(datagram, self.server)
            except OSError:  # resent at its next timer
                pass


def allocate(sock: Any, server: tuple[str, int], username: str, password: str, timeout: float,
             direct: bool = True) -> RelayedSocket:
    """A relay allocation for ``sock`` on ``server``, made before the socket carries data (blocking; raises
    TurnError within ``timeout``); ``direct`` as ``RelayedSocket`` takes it."""
    client = TurnClient(username, password)
    client.start(time.monotonic())
    where = f"{server[0]}:{server[1]}"
    try:
        exchange(sock, server, timeout, take=client.outgoing, timer=lambda: client.timer, on_timer=client.on_timer,
                 on_datagram=client.on_datagram, done=lambda: client.relayed is not None or client.error is not None,
                 silent=f"no relay allocation from the TURN server {where} within {timeout:.1f}s (it is unreachable, "
                        "or UDP is blocked on the way)")
    except StunError as exc:
        raise TurnError(str(exc)) from None
    if client.error is not None:
        raise TurnError(f"TURN server {where}: {client.error}")
    return RelayedSocket(sock, client, tuple(server), direct)  # type: ignore[arg-type]
