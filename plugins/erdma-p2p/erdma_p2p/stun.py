"""STUN Binding (RFC 5389) as a sans-IO state machine: the address a NAT maps a UDP socket to, asked from that
very socket (the one that will carry data), so the answer is the mapping peers must use.

``Binding`` takes the time as an argument and returns what to send and when to wake as data; ``query`` is
its thin adapter over a blocking UDP socket; ``query_tcp`` asks over TCP, from a given port, for the TCP
mapping a stream transport meets its peers from. Retransmission follows RFC 5389 section 7.2.1: the request goes
again after RTO, 2 RTO, 4 RTO, ... (Rc sends), and the transaction fails Rm x RTO after the last one.
Responses are checked strictly (magic cookie, transaction id, lengths) before any attribute is read;
anything else is ignored, as a stray datagram on a shared socket must be.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import NamedTuple

from erdma_core.toolkit import meet, recv_exact

MAGIC = 0x2112A442
BINDING_REQUEST, BINDING_SUCCESS, BINDING_ERROR = 0x0001, 0x0101, 0x0111
MAPPED_ADDRESS, XOR_MAPPED_ADDRESS, ERROR_CODE = 0x0001, 0x0020, 0x0009
_HEADER = struct.Struct("!HHI12s")  # type, length, magic cookie, transaction id
MAX_MESSAGE = 548  # RFC 5389: a response fits the path MTU; larger datagrams are not STUN answers to us


class StunError(Exception):
    """The server answered with an error, or never answered."""


class Mapped(NamedTuple):
    host: str
    port: int


def request(txid: bytes) -> bytes:
    """A Binding request with transaction id ``txid`` (12 bytes) and no attributes."""
    return _HEADER.pack(BINDING_REQUEST, 0, MAGIC, txid)


def parse(data: bytes, txid: bytes) -> Mapped | StunError | None:
    """The mapped address of a Binding success response to ``txid``, a StunError for an error response to
    it, or None for anything else (not STUN, another transaction, malformed)."""
    if not 20 <= len(data) <= MAX_MESSAGE:
        return None
    kind, length, magic, tid = _HEADER.unpack_from(data)
    if magic != MAGIC or tid != txid or length != len(data) - 20 or length % 4:
        return None
    attrs = attributes(data[20:])
    if attrs is None:
        return None
    if kind == BINDING_ERROR:
        err = attrs.get(ERROR_CODE, b"")
        code = (err[2] & 0x7) * 100 + err[3] if len(err) >= 4 else 0
        return StunError(f"STUN error {code}: {err[4:].decode(errors='replace')}")
    if kind != BINDING_SUCCESS:
        return None
    if XOR_MAPPED_ADDRESS in attrs:
        return address(attrs[XOR_MAPPED_ADDRESS], xor=True)
    if MAPPED_ADDRESS in attrs:
        return address(attrs[MAPPED_ADDRESS], xor=False)
    return None


def attributes(body: bytes) -> dict[int, bytes] | None:
    out, pos = {}, 0
    while pos < len(body):
        if pos + 4 > len(body):
            return None
        kind, length = struct.unpack_from("!HH", body, pos)
        end = pos + 4 + length
        if end > len(body):
            return None
        out.setdefault(kind, body[pos + 4:end])
        pos = end + (-length % 4)  # attributes are padded to 4 bytes
    return out


def address(value: bytes, xor: bool) -> Mapped | None:
    if len(value) != 8 or value[1] != 0x01:  # IPv4 only (family 1)
        return None
    port, raw = struct.unpack_from("!H4s", value, 2)
    if xor:
        port ^= MAGIC >> 16
        raw = bytes(a ^ b for a, b in zip(raw, struct.pack("!I", MAGIC), strict=True))
    return Mapped(str(ipaddress.IPv4Address(raw)), port)


class Binding:
    """One Binding transaction. ``start(now)`` and ``on_timer(now)`` return the datagram to send (or None);
    ``timer`` is when to call ``on_timer`` next; ``on_datagram(data)`` takes what arrived. ``result`` is the
    Mapped address, or a StunError, once the transaction is over."""

    def __init__(self, rto: float = 0.5, sends: int = 7, last_wait: int = 16, txid: bytes | None = None) -> None:
        self.txid = txid or os.urandom(12)
        self.rto, self.sends_left, self.last_wait = rto, sends, last_wait
        self.timer: float | None = None
        self.result: Mapped | StunError | None = None
        self._wait = rto

    def start(self, now: float) -> bytes:
        return self._send(now)

    def on_timer(self, now: float) -> bytes | None:
        if self.result is not None or self.timer is None or now < self.timer:
            return None
        if self.sends_left == 0:
            self.timer = None
            self.result = StunError("no STUN answer (the server is unreachable, or UDP is blocked on the way)")
            return None
        return self._send(now)

    def on_datagram(self, data: bytes) -> None:
        if self.result is not None:
            return
        got = parse(data, self.txid)
        if got is not None:
            self.result, self.timer = got, None

    def _send(self, now: float) -> bytes:
        self.sends_left -= 1
        self.timer = now + (self._wait if self.sends_left else self.rto * self.last_wait)
        self._wait *= 2
        return request(self.txid)


def exchange(sock: socket.socket, server: tuple[str, int], timeout: float, *, take: Callable[[], list[bytes]],
             timer: Callable[[], float | None], on_timer: Callable[[float], None],
             on_datagram: Callable[[bytes, float], None], done: Callable[[], bool], silent: str) -> None:
    """The blocking adapter of a request/response state machine on ``sock`` (before it carries data): send
    what ``take()`` gives to ``server``, feed it the server's datagrams and its timer, until ``done()``;
    ``silent`` (a StunError) at ``timeout``. Datagrams from elsewhere are dropped."""
    deadline = time.monotonic() + timeout
    old = sock.gettimeout()
    try:
        while not done():
            for datagram in take():
                sock.sendto(datagram, server)
            now = time.monotonic()
            if done():
                return
            if now >= deadline:
                raise StunError(silent)
            at = timer()
            sock.settimeout(max(0.001, min(deadline, at if at is not None else deadline) - now))
            try:
                data, src = sock.recvfrom(65536)
            except (TimeoutError, BlockingIOError):
                on_timer(time.monotonic())
                continue
            if tuple(src[:2]) == tuple(server):
                on_datagram(data, time.monotonic())
    finally:
        sock.settimeout(old)


def query(sock: socket.socket, server: tuple[str, int], timeout: float, rto: float = 0.5) -> Mapped:
    """The address ``server`` sees ``sock`` as (its NAT mapping); raises StunError within ``timeout``.
    Datagrams from elsewhere that arrive meanwhile are dropped (call it before the socket carries data)."""
    b = Binding(rto=rto)
    out = [b.start(time.monotonic())]

    def on_timer(now: float) -> None:
        again = b.on_timer(now)
        if again is not None:
            out.append(again)

    def take() -> list[bytes]:
        sent = out[:]
        out.clear()
        return sent

    exchange(sock, server, timeout, take=take, timer=lambda: b.timer, on_timer=on_timer,
             on_datagram=lambda data, now: b.on_datagram(data), done=lambda: b.result is not None,
             silent=f"no STUN answer from {server[0]}:{server[1]} within {timeout:.1f}s (the server is unreachable, "
                    "or UDP is blocked on the way)")
    if isinstance(b.result, StunError):
        raise b.result
    assert b.result is not None
    return b.result


def query_tcp(local: tuple[str, int], server: tuple[str, int], timeout: float) -> Mapped:
    """The address ``server`` sees a TCP connection from ``local`` as (its NAT's TCP mapping of that port),
    over STUN on TCP (RFC 5389 7.2.2: the messages back to back, each its own length); the connection is
    made from a socket bound to ``local`` beside the others there (SO_REUSEADDR, SO_REUSEPORT) and closed
    after the answer. Raises StunError within ``timeout``."""
    txid = os.urandom(12)
    deadline = time.monotonic() + timeout
    sock = meet.bound_to(local)
    try:
        sock.settimeout(timeout)
        sock.connect(server)
        sock.sendall(request(txid))
        while True:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            head = recv_exact(sock, 20)
            data = head + recv_exact(sock, min(MAX_MESSAGE, int.from_bytes(head[2:4], "big")))
            got = parse(data, txid)
            if isinstance(got, StunError):
                raise got
            if got is not None:
                return got
    except (OSError, ConnectionError) as exc:
        raise StunError(f"no STUN answer over TCP from {server[0]}:{server[1]} within {timeout:.1f}s ({exc}): the "
                        "server does not serve TCP, is unreachable, or TCP is blocked on the way") from None
    finally:
        sock.close()
