"""Address validation before any state (RFC 9000 8.1.2), sans-IO: a listener answers a client's first Initial
with a Retry whose token only it can make, and keeps nothing; the client sends its Initial again with the token,
which proves it receives at the address it sends from. Only then does the listener make a connection for it.

The token is stateless: an HMAC, under a key this endpoint drew at start, of the client's address, the
destination id of its first Initial (``original``: the connection must name it in its transport parameters),
the Retry's own source id (the destination of the second Initial) and an expiry. A token from another
endpoint, address or time, or one altered, checks as nothing. ``Mesh`` asks for a Retry once its table of
handshakes under way passes a threshold (``RETRY_ABOVE``), as ngtcp2's and quiche's servers may; below it,
the first Initial is taken at once and set-up costs no extra round trip.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Any

import attrs
from aioquic.buffer import Buffer
from aioquic.quic.packet import QuicPacketType, encode_quic_retry, pull_quic_header

VERSION_1 = 0x00000001
MIN_INITIAL = 1200  # RFC 9000 14.1: a server discards a datagram with a client Initial smaller than this
TOKEN_LIFE = 10.0  # seconds a Retry's token is good for
_TAG = 16  # bytes of HMAC-SHA256 a token keeps
_HEAD = struct.Struct("!dB")  # expiry (the mesh's clock), length of the original destination id


@attrs.frozen
class Initial:
    """What a client's Initial says of itself: its ids, its token (empty: none)."""

    destination: bytes
    source: bytes
    token: bytes


def initial(data: bytes) -> Initial | None:
    """``data``'s first packet if it is a QUIC v1 client Initial in a datagram of at least ``MIN_INITIAL``
    bytes, else None (another version, another type, a short datagram, a header that does not parse)."""
    if len(data) < MIN_INITIAL or data[0] & 0xB0 != 0x80 or data[1:5] != b"\x00\x00\x00\x01":
        return None  # (long header, Initial type: the two type bits are 0 in version 1)
    try:
        header = pull_quic_header(Buffer(data=data), host_cid_length=8)
    except ValueError:
        return None
    if header.packet_type != QuicPacketType.INITIAL or not header.destination_cid or len(header.destination_cid) < 8:
        return None  # RFC 9000 7.2: a client's first destination id is at least 8 bytes
    return Initial(header.destination_cid, header.source_cid, header.token)


class RetryGate:
    """Makes Retry packets and checks the tokens they carried; one per endpoint (its key lives as long)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or os.urandom(32)

    def retry(self, packet: Initial, addr: Any, now: float) -> bytes:
        """The Retry that answers ``packet`` from ``addr``."""
        source = os.urandom(8)
        return encode_quic_retry(VERSION_1, source_cid=source, destination_cid=packet.source,
                                 original_destination_cid=packet.destination,
                                 retry_token=self._token(addr, packet.destination, source, now + TOKEN_LIFE))

    def original(self, packet: Initial, addr: Any, now: float) -> bytes | None:
        """The destination id of the Initial a Retry answered, when ``packet`` carries a token this gate made
        for ``addr`` and the Retry's id, and it has not expired; None otherwise."""
        token = packet.token
        if len(token) < _HEAD.size + _TAG:
            return None
        expires, n = _HEAD.unpack_from(token)
        original = token[_HEAD.size:_HEAD.size + n]
        if len(token) != _HEAD.size + n + _TAG or expires < now or expires > now + TOKEN_LIFE:
            return None
        want = self._token(addr, original, packet.destination, expires)
        return original if hmac.compare_digest(token, want) else None

    def _token(self, addr: Any, original: bytes, source: bytes, expires: float) -> bytes:
        body = _HEAD.pack(expires, len(original)) + original
        said = f"{addr[0]}|{addr[1]}".encode() + b"|" + source + b"|" + body
        return body + hmac.new(self._key, said, hashlib.sha256).digest()[:_TAG]
