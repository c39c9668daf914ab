"""TURN over TCP and over TLS (RFC 8656 section 3.1): the client talks to its TURN server over one TCP
connection, or one TLS connection whose server certificate it checks, and the server still relays UDP
datagrams to the peers. For a site whose firewall drops UDP (or lets only TLS out), this is the one way in.

``TcpDatagrams`` makes that connection look like the UDP socket the TURN client's adapter (``relayed.py``)
expects: ``sendto(message, server)`` writes one STUN message or ChannelData (padded to a multiple of 4 bytes, as
RFC 8656 section 12.5 asks over a stream), and ``recvfrom`` returns one whole message at a time, cut from the
stream by its own length field, as if it had come from the server. Its descriptor is the connection's, so the
transport's event loop wakes when bytes arrive. When the server closes the connection, the error queue reports
the server unreachable once, as an ICMP error would for UDP, so that every peer reached through it is lost at
once.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import threading
import time
from typing import Any

SEND_TIMEOUT_S = 30.0  # a write the server does not take within this fails (SO_SNDTIMEO)
_MAX_FRAME = 4 + 65535 + 3


def frame_length(head: bytes) -> int | None:
    """The length on the stream of the frame whose first 4 bytes are ``head``: a STUN message (first two bits
    00: 20 bytes of header and its length) or ChannelData (01: 4 bytes and its length, padded to 4); None for
    anything else (the stream is not TURN)."""
    kind, length = struct.unpack("!HH", head)
    if kind >> 14 == 0:
        return 20 + length
    if kind >> 14 == 1:
        return 4 + length + (-length % 4)
    return None


class TcpDatagrams:
    """A connected TCP socket to a TURN server, seen as a datagram socket that only talks to that server."""

    def __init__(self, sock: socket.socket, server: tuple[str, int]) -> None:
        self.sock, self.server = sock, server
        self._buf = bytearray()
        self._timeout: float | None = None  # what ``settimeout`` asked (blocking reads wait this long)
        self._ended = False  # the server closed the connection (reported once through the error queue)
        self._told = False
        self._tls = threading.Lock()  # one TLS object: never read and written by two threads at once

    @classmethod
    def connect(cls, server: tuple[str, int], timeout: float, tls: ssl.SSLContext | None = None) -> TcpDatagrams:
        """A connection to ``server``; with ``tls``, a TLS one whose certificate names ``server``'s host
        (ssl.SSLError when it does not, or its CA is not trusted), its handshake within ``timeout``."""
        sock = socket.create_connection(server, timeout=timeout)
        try:
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=server[0])  # the handshake, within the timeout
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)  # reads never block (MSG_DONTWAIT); a write that cannot leave fails after:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock, server)

    # ---- what a UDP socket offers ------------------------------------------------------------------------
    def fileno(self) -> int:
        return self.sock.fileno()

    def getsockname(self) -> Any:
        return self.sock.getsockname()

    def setblocking(self, flag: bool) -> None:
        self._timeout = None if flag else 0.0

    def settimeout(self, value: float | None) -> None:
        self._timeout = value

    def gettimeout(self) -> float | None:
        return self._timeout

    def setsockopt(self, level: int, option: int, value: Any) -> None:
        """Socket-level options (buffer sizes) are the connection's; UDP's and IP's have no meaning here."""
        if level == socket.SOL_SOCKET:
            self.sock.setsockopt(level, option, value)

    def getsockopt(self, *args: Any) -> Any:
        return self.sock.getsockopt(*args)

    def sendto(self, data: bytes | memoryview, addr: tuple[str, int]) -> int:
        """``data`` (one STUN message or ChannelData) to the server; nothing else is reachable from here."""
        if tuple(addr[:2]) != tuple(self.server):
            raise OSError(f"TURN over TCP reaches only its server {self.server[0]}:{self.server[1]}, not "
                          f"{addr[0]}:{addr[1]}")
        pad = b"\0" * (-len(data) % 4) if len(data) >= 1 and data[0] >> 6 == 1 else b""
        if isinstance(self.sock, ssl.SSLSocket):
            with self._tls:
                self.sock.sendall(bytes(data) + pad)
        else:
            self.sock.sendall(bytes(data) + pad)
        return len(data)

    def recvfrom(self, size: int) -> tuple[bytes, tuple[str, int]]:
        """The next whole message from the server; BlockingIOError when none is whole yet (TimeoutError after
        ``settimeout``'s seconds when reads block)."""
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while True:
            got = self._cut()
            if got is not None:
                return got, self.server
            if self._ended:
                raise BlockingIOError("the TURN server closed the connection")
            if self._timeout == 0.0:  # the transport's loop: no system call but the read
                chunk = self._read_now()
            else:  # the allocation's exchange, before the socket carries data
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("no message from the TURN server")
                self.sock.settimeout(left)
                try:
                    chunk = self.sock.recv(65536)
                finally:
                    self.sock.settimeout(None)
            if not chunk:
                self._ended = True
                raise OSError("the TURN server closed the connection")  # the caller reads the error queue
            self._buf += chunk

    def _read_now(self) -> bytes:
        """What has arrived, without waiting (BlockingIOError: nothing). Over TLS, what the TLS layer holds
        decrypted comes first (the descriptor does not show it), and a record not yet whole is nothing."""
        if not isinstance(self.sock, ssl.SSLSocket):
            return self.sock.recv(65536, socket.MSG_DONTWAIT)
        with self._tls:
            if not self.sock.pending() and not select.select([self.sock], [], [], 0)[0]:
                raise BlockingIOError("nothing from the TURN server yet")
            self.sock.setblocking(False)
            try:
                return self.sock.recv(65536)
            except ssl.SSLWantReadError:
                raise BlockingIOError("a TLS record from the TURN server is not whole yet") from None
            finally:
                self.sock.setblocking(True)

    def recvmsg(self, bufsize: int, ancbufsize: int = 0, flags: int = 0) -> Any:
        """The error queue: once the server has closed the connection, one error from the server's address."""
        if flags & socket.MSG_ERRQUEUE and self._ended and not self._told:
            self._told = True
            return b"", [], 0, self.server
        raise BlockingIOError

    def close(self) -> None:
        self.sock.close()

    def _cut(self) -> bytes | None:
        if len(self._buf) < 4:
            return None
        length = frame_length(bytes(self._buf[:4]))
        if length is None or length > _MAX_FRAME:
            self._ended = True
            self._buf.clear()
            raise OSError("the TURN server sent bytes that are neither STUN nor ChannelData")
        if len(self._buf) < length:
            return None
        out = bytes(self._buf[:length])
        del self._buf[:length]
        if out[0] >> 6 == 1:  # ChannelData: the padding is not the payload's
            out = out[:4 + struct.unpack_from("!H", out, 2)[0]]
        return out
