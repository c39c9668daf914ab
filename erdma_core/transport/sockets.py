"""Blocking-socket helpers shared by the rendezvous store and the TCP transport."""

from __future__ import annotations

import socket
import time


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


def dial(host: str, port: int, deadline: float) -> socket.socket:
    """Connect, retrying with back-off until ``deadline`` (time.monotonic()); then raise the last OSError."""
    delay = 0.01
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
        except OSError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 0.5)
