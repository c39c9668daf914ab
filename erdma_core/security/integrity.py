"""Frame integrity on a byte stream that leaves the host, sans-IO: every frame carries tags its receiver
checks before the frame is acted on or its receive completes, keyed per connection by the job's secret.

A sealed frame is the wire header (``wire.FRAME``), ``SEAL``, the payload, and after a non-empty payload
its ``TAG``-byte tag::

    counter  Q   frames this sender sealed on this connection, this one included (1, 2, ...)
    htag    16s  GMAC of the header and the counter (nonce: counter, 0)
    payload      ``nbytes`` bytes
    ptag    16s  GMAC of the payload (nonce: counter, 1)

GMAC is AES-GCM with everything as associated data and nothing encrypted (NIST SP 800-38D), computed by
OpenSSL through ``cryptography``: with AES-NI and carry-less multiplication it runs faster than a memory
copy while the bytes are in the cache, and at the memory's speed when they are not. So a large payload is
moved ``PIECE`` bytes at a time and each piece tagged just after the socket copied it (sender,
``SealedFrame``) or just after it arrived (receiver): the tag then costs one pass over cached bytes instead
of one more pass over memory (README.md, "Security", gives the cost). The tag after the payload is what
lets the sender do that. Each direction of each connection has its own key, derived from the job's key and the handshake that
opened the connection (both sides' fresh nonces), so a counter is never used twice under a key and a frame
recorded on one connection fails on every other. The receiver takes each counter once, within a window of
``WINDOW`` frames below the highest it has seen (frames sealed by two threads, or an urgent ABORT, may leave
in another order than they were sealed), and fails on anything else.

The header's tag is checked as soon as the header is in, so a damaged header is an ``IntegrityError``, not
a frame sent somewhere else; the payload's once the payload is in, before its receive completes (a large
payload lands in the receive's memory first, so a receive that fails may hold the damaged bytes; no call
returns them and no reduction reads them). Without a secret the keys are still per connection (fresh
nonces), which catches every corruption a faulty path makes; only a secret stops someone who rewrites the
stream on purpose.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import struct

from cryptography.hazmat.primitives.ciphers import AEADEncryptionContext, Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import IntegrityError

SEAL = struct.Struct("<Q16s")
TAG = 16
WINDOW = 64  # frames a counter may lag the highest one taken
PIECE = 1 << 18  # payload bytes tagged at a time: they stay in the cache between the tag and the copy
_HEADER, _PAYLOAD = b"\0\0\0\0", b"\1\0\0\0"  # a nonce is the counter (8 bytes, little-endian), then one of these
_WHOLE = 1 << 30  # AAD handed to OpenSSL in one call at most (it takes less than 2**31 bytes)
_DIAL, _ACCEPT = b"dialler", b"acceptor"


def keys(job_key: bytes, transcript: bytes, dialled: bool) -> tuple[bytes, bytes]:
    """``(send key, receive key)`` of one end of a connection: ``transcript`` is the handshake's
    (``auth``), ``dialled`` whether this end dialled it."""
    mine, theirs = (_DIAL, _ACCEPT) if dialled else (_ACCEPT, _DIAL)
    return _derive(job_key, mine, transcript), _derive(job_key, theirs, transcript)


def _derive(job_key: bytes, sender: bytes, transcript: bytes) -> bytes:
    return hmac.new(job_key, b"erdma frame key|" + sender + b"|" + transcript, hashlib.sha256).digest()


def trailer(nbytes: int) -> int:
    """Bytes after a payload of ``nbytes``: its tag, when it has one."""
    return TAG if nbytes else 0


class Window:
    """Counters taken once each, out of order within ``size``: ``take(n)`` is True for a counter not taken
    before and less than ``size`` below the highest taken (and records it), False for one taken already or
    too old. ``top`` starts as taken (0 by default: counters start at 1)."""

    __slots__ = ("_seen", "size", "top")

    def __init__(self, size: int, top: int = 0) -> None:
        self.size, self.top = size, top
        self._seen = 1  # bit i: counter top - i taken

    def take(self, n: int) -> bool:
        if n > self.top:
            shift = n - self.top
            self._seen = ((self._seen << shift) | 1) & ((1 << self.size) - 1) if shift < self.size else 1
            self.top = n
            return True
        back = self.top - n
        if back >= self.size or self._seen >> back & 1:
            return False
        self._seen |= 1 << back
        return True


class _Gmac:
    """GMAC under one key: ``tag(nonce, data)`` at once, or ``stream(nonce)`` for data that comes in pieces
    (the same tag)."""

    __slots__ = ("_key", "aead")

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.aead = AESGCM(key)

    def tag(self, nonce: bytes, data: bytes | memoryview) -> bytes:
        if len(data) <= _WHOLE:
            return self.aead.encrypt(nonce, b"", data)
        piecewise = self.stream(nonce)
        view = memoryview(data)
        for at in range(0, len(view), _WHOLE):
            piecewise.authenticate_additional_data(view[at:at + _WHOLE])
        piecewise.finalize()
        return piecewise.tag

    def stream(self, nonce: bytes) -> AEADEncryptionContext:
        return Cipher(algorithms.AES(self._key), modes.GCM(nonce)).encryptor()


class SealedFrame:
    """A frame whose payload is tagged piece by piece as it is written: ``views()`` is what to write next (the
    rest of the header and seal, then at most ``PIECE`` payload bytes, then the tag), ``wrote(n)`` says how many
    of them went out, and tags the payload bytes among them while the copy that sent them left them in the
    cache; ``left`` is how many bytes remain."""

    __slots__ = ("_at", "_head", "_payload", "_stream", "_tag", "left")

    def __init__(self, head: bytes, payload: memoryview, stream: AEADEncryptionContext) -> None:
        self._head = memoryview(head)
        self._payload, self._stream = payload, stream
        self._at = 0  # payload bytes written (and tagged)
        self._tag = memoryview(b"")  # what is left of the tag, once the payload is all out
        self.left = len(head) + payload.nbytes + TAG

    def views(self) -> list[memoryview]:
        out = [self._head] if self._head.nbytes else []
        if self._at < self._payload.nbytes:
            out.append(self._payload[self._at:self._at + PIECE])
        else:
            out.append(self._tag)
        return out

    def wrote(self, n: int) -> None:
        self.left -= n
        k = min(n, self._head.nbytes)
        self._head, n = self._head[k:], n - k
        if self._at < self._payload.nbytes and n:
            end = self._at + n
            self._stream.authenticate_additional_data(self._payload[self._at:end])
            self._at = end
            if end == self._payload.nbytes:
                self._stream.finalize()
                self._tag = memoryview(self._stream.tag)
            return
        self._tag = self._tag[n:]


class Sealer:
    """The sending end: ``seal(head, payload)`` returns ``(prefix, tail)``: write ``prefix``, the payload,
    then ``tail`` (its tag, or nothing for an empty payload); or, for a payload larger than ``PIECE``, a
    ``SealedFrame`` that tags the payload as it is written (``tail`` is then None). Thread-safe: each call
    takes the next counter."""

    __slots__ = ("_aead", "_counter", "_mac")

    def __init__(self, key: bytes) -> None:
        self._mac = _Gmac(key)
        self._aead = self._mac.aead  # called directly for the two small tags of every frame
        self._counter = itertools.count(1)  # next() is atomic under the GIL

    def seal(self, head: bytes, payload: memoryview) -> tuple[bytes | SealedFrame, bytes | None]:
        if payload.nbytes > PIECE:
            counter, head = self._head(head)
            return SealedFrame(head, payload, self._mac.stream(counter + _PAYLOAD)), None
        return self.whole(head, payload)

    def whole(self, head: bytes, payload: memoryview) -> tuple[bytes, bytes]:
        """``(prefix, tail)`` for a payload of any size, tagged at once (for a transport that writes the
        payload itself, as erdma-dpdk's shim does)."""
        counter, head = self._head(head)
        return head, self._mac.tag(counter + _PAYLOAD, payload) if payload.nbytes else b""

    def _head(self, head: bytes) -> tuple[bytes, bytes]:
        counter = next(self._counter).to_bytes(8, "little")
        head += counter
        return counter, head + self._aead.encrypt(counter + _HEADER, b"", head)


class Checker:
    """The receiving end, for one reader. ``header(prefix)`` checks a frame's header and ``SEAL`` (``prefix``:
    ``len(head) + SEAL.size`` bytes) and returns its counter; then the payload (when it is not empty), with
    ``payload(counter, data, tag)`` when it is all there, or in pieces: ``stream(counter)`` and
    ``authenticate_additional_data(piece)`` on it for each, then ``streamed(counter, stream, tag)``.
    Failures raise ``IntegrityError`` naming ``where`` (the link) and ``peer``."""

    __slots__ = ("_aead", "_mac", "_window", "peer", "rank", "where")

    def __init__(self, key: bytes, *, rank: int, peer: int, where: str) -> None:
        self._mac = _Gmac(key)
        self._aead = self._mac.aead  # called directly for the header's tag of every frame
        self.rank, self.peer, self.where = rank, peer, where
        self._window = Window(WINDOW)

    def header(self, prefix: memoryview) -> int:
        at = len(prefix) - TAG
        counter = bytes(prefix[at - 8:at])
        n = int.from_bytes(counter, "little")
        if not hmac.compare_digest(self._aead.encrypt(counter + _HEADER, b"", prefix[:at]), prefix[at:]):
            raise self._failed(f"the header's tag does not match (frame {n})")
        if not self._window.take(n):
            raise self._failed(f"frame {n} came again or too late (the highest so far is {self._window.top})")
        return n

    def payload(self, counter: int, data: memoryview, tag: memoryview) -> None:
        """Check a whole non-empty payload against ``tag`` (the bytes after it)."""
        if not hmac.compare_digest(self._mac.tag(counter.to_bytes(8, "little") + _PAYLOAD, data), tag):
            raise self._failed(f"the payload's tag does not match (frame {counter})")

    def stream(self, counter: int) -> AEADEncryptionContext:
        """Where the pieces of frame ``counter``'s payload go, in order, as they come."""
        return self._mac.stream(counter.to_bytes(8, "little") + _PAYLOAD)

    def streamed(self, counter: int, stream: AEADEncryptionContext, tag: memoryview) -> None:
        """Check a payload that came through ``stream`` against ``tag``."""
        stream.finalize()
        if not hmac.compare_digest(stream.tag, tag):
            raise self._failed(f"the payload's tag does not match (frame {counter})")

    def _failed(self, what: str) -> IntegrityError:
        return IntegrityError(f"rank {self.rank}: integrity check failed on a frame from rank {self.peer} over "
                              f"{self.where}: {what}; the bytes were changed on the way (a faulty NIC, "
                              "middlebox or someone on the path)", peer=self.peer, rank=self.rank)
