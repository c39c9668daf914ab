"""The members' control mesh on the wire, sans-IO: a mutual handshake on the job's secret that binds both member
ids to the connection, then frames sealed with a key of that connection alone.

Handshake (the dialler ``d`` wants member ``a``; every length-prefixed field is one byte of length then bytes)::

    d -> a   MAGIC(4) | VERSION(1) | nonce_d(16) | job | id_d | id_a
    a -> d   nonce_a(16) | HMAC(key, "mesh acceptor" | transcript)
    d -> a   HMAC(key, "mesh dialler" | transcript)

with ``transcript = job | id_d | id_a | nonce_d | nonce_a`` and ``key`` derived from ``security.secret``.
Each side proves it knows the secret against the other's fresh nonce; the two labels differ, so one side's
answer cannot be reflected back as the other's, and an acceptor answers only hellos naming itself and the job.

Frames: ``length(4, big endian) | seq(8) | payload | HMAC(session, direction | seq | payload)[:16]``, with
``session`` derived from the key and the transcript, and ``seq`` counting up from 0 in each direction: a frame
changed, replayed, reordered or taken from another connection fails its check, and the connection is dropped.
A length above ``MAX_FRAME`` is refused before anything is allocated for it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from ..errors import AuthenticationError, ProtocolError
from ..security import auth
from . import paxos

MAGIC = b"ERMH"
VERSION = 1
TAG = 16  # bytes of a frame's HMAC kept
MAX_FRAME = paxos.MAX_VALUE + 4096  # a frame's payload: one paxos message (a value and its key)
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


def _field(text: str) -> bytes:
    raw = text.encode()
    if not 0 < len(raw) <= paxos.MAX_ID:
        raise ValueError(f"mesh: an id or job name of {len(raw)} bytes (1 to {paxos.MAX_ID})")
    return bytes([len(raw)]) + raw


def _fields(data: bytes, count: int) -> tuple[list[str], bytes]:
    out = []
    for _ in range(count):
        if not data or len(data) < 1 + data[0] or not 0 < data[0] <= paxos.MAX_ID:
            raise ProtocolError("mesh: a malformed hello")
        out.append(data[1:1 + data[0]].decode(errors="replace"))
        data = data[1 + data[0]:]
    return out, data


def mesh_key(secret: bytes) -> bytes:
    return auth.derive(secret, b"elastic mesh")


class Session:
    def __init__(self, key: bytes, transcript: bytes, dialler: bool) -> None:
        self._key = hmac.new(key, b"mesh session|" + transcript, hashlib.sha256).digest()
        self._out_label, self._in_label = (b"d>a", b"a>d") if dialler else (b"a>d", b"d>a")
        self._sent = self._got = 0

    def _tag(self, label: bytes, seq: int, payload: bytes) -> bytes:
        return hmac.new(self._key, label + _SEQ.pack(seq) + payload, hashlib.sha256).digest()[:TAG]

    def seal(self, payload: bytes) -> bytes:
        if len(payload) > MAX_FRAME:
            raise ValueError(f"mesh: a frame of {len(payload)} bytes (at most {MAX_FRAME})")
        seq, self._sent = self._sent, self._sent + 1
        body = _SEQ.pack(seq) + payload + self._tag(self._out_label, seq, payload)
        return _LEN.pack(len(body)) + body

    def open(self, seq: int, payload: bytes, tag: bytes) -> bytes:
        if seq != self._got or not hmac.compare_digest(tag, self._tag(self._in_label, seq, payload)):
            raise ProtocolError(f"mesh: frame {seq} failed its check (expected frame {self._got}): changed, "
                                "replayed or from another connection")
        self._got += 1
        return payload


class FrameReader:
    """Bytes in, checked payloads out: ``feed(data) -> [payload, ...]``; ProtocolError drops the connection."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out = []
        while len(self._buf) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._buf)
            if not _SEQ.size + TAG <= size <= _SEQ.size + MAX_FRAME + TAG:
                raise ProtocolError(f"mesh: a frame of {size} bytes announced (at most {MAX_FRAME + _SEQ.size + TAG})")
            if len(self._buf) < _LEN.size + size:
                break
            body = bytes(self._buf[_LEN.size:_LEN.size + size])
            del self._buf[:_LEN.size + size]
            (seq,) = _SEQ.unpack_from(body)
            out.append(self._session.open(seq, body[_SEQ.size:-TAG], body[-TAG:]))
        return out


def _transcript(job: str, dialler: str, acceptor: str, n_d: bytes, n_a: bytes) -> bytes:
    return _field(job) + _field(dialler) + _field(acceptor) + n_d + n_a


class Dialling:
    """The dialler's side: ``hello()`` to send, then ``on_challenge(42+ bytes) -> proof`` (raises
    AuthenticationError when the acceptor does not know the secret); then ``session`` seals frames."""

    CHALLENGE = auth.NONCE + 32

    def __init__(self, key: bytes, job: str, me: str, peer: str) -> None:
        self.key, self.job, self.me, self.peer = key, job, me, peer
        self.nonce = auth.nonce()
        self.session: Session | None = None

    def hello(self) -> bytes:
        return MAGIC + bytes([VERSION]) + self.nonce + _field(self.job) + _field(self.me) + _field(self.peer)

    def on_challenge(self, data: bytes) -> bytes:
        n_a, mac = data[:auth.NONCE], data[auth.NONCE:self.CHALLENGE]
        transcript = _transcript(self.job, self.me, self.peer, self.nonce, n_a)
        if len(data) != self.CHALLENGE or not auth.check(self.key, b"mesh acceptor", transcript, mac):
            raise AuthenticationError(f"elastic mesh: member {self.peer!r} could not prove it knows the job's "
                                      "secret (another job, or another secret)")
        self.session = Session(self.key, transcript, dialler=True)
        return auth.prove(self.key, b"mesh dialler", transcript)


class Accepting:
    """The acceptor's side: ``on_hello(bytes) -> challenge`` (ProtocolError for a hello not naming this member
    and job), then ``on_proof(32 bytes)`` (AuthenticationError when wrong); then ``peer`` and ``session``."""

    PROOF = 32

    def __init__(self, key: bytes, job: str, me: str) -> None:
        self.key, self.job, self.me = key, job, me
        self.peer = ""
        self._transcript = b""
        self.session: Session | None = None

    @staticmethod
    def hello_size(head: bytes) -> int | None:
        """How long the hello starting with ``head`` is, once enough of it is there (None: read more)."""
        at = len(MAGIC) + 1 + auth.NONCE
        if len(head) >= len(MAGIC) and head[:len(MAGIC)] != MAGIC:
            raise ProtocolError("mesh: not a mesh hello")
        for _ in range(3):
            if len(head) <= at:
                return None
            at += 1 + head[at]
        return at

    def on_hello(self, data: bytes) -> bytes:
        if data[:len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + 1 + auth.NONCE:
            raise ProtocolError("mesh: not a mesh hello")
        if data[len(MAGIC)] != VERSION:
            raise ProtocolError(f"mesh: hello of version {data[len(MAGIC)]} (this member speaks {VERSION})")
        n_d = data[len(MAGIC) + 1:len(MAGIC) + 1 + auth.NONCE]
        (job, dialler, acceptor), rest = _fields(data[len(MAGIC) + 1 + auth.NONCE:], 3)
        if rest or job != self.job or acceptor != self.me:
            raise ProtocolError(f"mesh: a hello for member {acceptor!r} of job {job!r} reached {self.me!r} of "
                                f"{self.job!r}")
        n_a = auth.nonce()
        self.peer = dialler
        self._transcript = _transcript(job, dialler, acceptor, n_d, n_a)
        return n_a + auth.prove(self.key, b"mesh acceptor", self._transcript)

    def on_proof(self, mac: bytes) -> None:
        if not self._transcript or not auth.check(self.key, b"mesh dialler", self._transcript, mac):
            raise AuthenticationError(f"elastic mesh: a peer calling itself {self.peer!r} could not prove it knows "
                                      "the job's secret")
        self.session = Session(self.key, self._transcript, dialler=False)
