"""Blocking-socket helpers shared by the discovery store and the stream transports."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes; ConnectionError if the peer closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed before the message was complete")
        got += k
    return bytes(buf)


def close_gently(sock: socket.socket) -> None:
    """Close ``sock`` so that the peer reads the end of the stream (not a reset) even when bytes it sent are
    left unread here."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()


def probe_idle(sock: socket.socket, on: bool = True) -> None:
    """While a TCP ``sock`` waits in a handshake (``on``), probe the peer after each idle second: a peer
    that dropped the connection answers a probe with a reset, so a lost FIN or reset is noticed in seconds,
    not at the deadline; a live peer just acknowledges. ``on=False`` turns the probes off again."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, int(on))
    if on:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 127)


def retrying(connect: Callable[[float], T], deadline: float) -> T:
    """``connect(timeout)`` until it succeeds, with back-off, until ``deadline`` (time.monotonic()); then
    raise the last OSError. For dialling a peer that may not be listening yet."""
    delay = 0.01
    while True:
        try:
            return connect(max(0.1, deadline - time.monotonic()))
        except OSError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 0.5)


def dial(host: str, port: int, deadline: float) -> socket.socket:
    """A TCP connection to ``host:port``, retried until ``deadline``."""
    return retrying(lambda timeout: socket.create_connection((host, port), timeout=timeout), deadline)
