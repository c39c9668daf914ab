"""The eRDMA wire format, written down once. All integers little-endian; every code is an explicit number
that never changes meaning (``tests/test_wire.py`` pins each one).

HELLO of the QUIC transport (inside mutual TLS; sent by the dialling rank, echoed by the accepting rank
with ``status``), 32 bytes. The stream transports (TCP, Unix) prove the job's secret with the HELLO of wire
version 5 written down in ``auth`` (44 bytes: these fields but ``spare``, then which of the pair's
connections it opens and how many, and a 16-byte nonce; followed by 32-byte HMAC proofs)::

    magic  4s  b"ERDH"
    version H  WIRE_VERSION
    status  H  0 = request, 1 = accepted, 2 = rejected
    job     Q  job id (drawn by rank 0, agreed through the discovery store)
    rank    I  sender's global rank
    world   I  world size
    spare   Q  0

FRAME header, 64 bytes, followed by ``nbytes`` of payload (on a TCP connection without TLS, by the 40-byte
``integrity.SEAL`` and then the payload)::

    magic  4s  b"ERDF"
    kind    B  1 = DATA, 2 = ABORT (payload: ABORT_BODY, the error's code in ABORT_CODES and the rank it names,
               then the UTF-8 reason), 3 = BYE (closing; ``seq``
               is the number of DATA frames the sender sent to this peer before it), 4 = PULL (a DATA frame
               whose payload stays in the sender's memory for the receiver to read, ``single_copy``: the
               payload on the wire is LENT, and every other field is the DATA frame's), 5 = PULLED (the
               receiver read the PULL frame whose ticket is ``seq``: that memory is the sender's again)
    dtype   B  erdma_core.protocol.dtypes code (0 when not a typed payload)
    opcode  B  erdma_core.protocol.ops code of the collective (0 for ABORT and BYE)
    redop   B  ReduceOp code of the collective (0: none)
    job     I  low 32 bits of the job id
    root    I  the root rank (in the group) of broadcast, reduce, gather and scatter; NO_ROOT (0xFFFFFFFF) else
    group   I  process-group id (bit 31 set: point-to-point send/recv; bit 30: the group's host channel of
               an offloaded collective, ``erdma_core.engine.offload``)
    tag     I  message index inside the collective
    seq     Q  collective sequence number in the group (send/recv: the user tag)
    codec   I  0 = raw elements; else the id of the compressor that encoded the payload (``codec_id``)
    meta    I  bytes of codec metadata at the start of the payload (0 when raw)
    numel   Q  element count every rank must agree on for the whole op (0: not checked)
    count   Q  elements this message carries once decoded
    nbytes  Q  payload length on the wire
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, NamedTuple

import attrs

from .errors import (
    AbortedError,
    CollectiveError,
    CollectiveTimeoutError,
    IntegrityError,
    MismatchError,
    PeerLostError,
    ProtocolError,
)

WIRE_VERSION = 5
HELLO = struct.Struct("<4sHHQIIQ")
HELLO_MAGIC = b"ERDH"
FRAME = struct.Struct("<4sBBBBIIIIQIIQQQ")
NO_ROOT = 0xFFFFFFFF
FRAME_MAGIC = b"ERDF"
DATA, ABORT, BYE, PULL, PULLED = 1, 2, 3, 4, 5
HELLO_REQUEST, HELLO_ACCEPTED, HELLO_REJECTED = 0, 1, 2
RAW = 0  # codec of an unencoded payload
P2P_GROUP_BIT = 1 << 31
CONTROL_GROUP_BIT = 1 << 30  # an offloaded collective's host channel (``engine.offload.HostChannel``)
MAX_PAYLOAD = 1 << 40
MAX_CONTROL_BYTES = 1 << 16  # ABORT and BYE payloads
ABORT_BODY = struct.Struct("<Bi")  # ABORT payload: error class code, the peer it names (or -1), then the UTF-8 reason
LENT = struct.Struct("<QQQ")  # PULL payload: address in the sender's process, payload bytes, ticket
ABORT_CODES: dict[type[CollectiveError], int] = {MismatchError: 1, PeerLostError: 2, CollectiveTimeoutError: 3,
                                                  IntegrityError: 4}


def codec_id(name: str) -> int:
    """The wire id of the compressor called ``name``: CRC-32 of ``b"erdma-codec:" + name`` (0 is RAW)."""
    return zlib.crc32(b"erdma-codec:" + name.encode())


def abort_body(error: BaseException) -> bytes:
    """The payload of an ABORT frame telling peers why this rank gave up."""
    code = next((c for cls, c in ABORT_CODES.items() if isinstance(error, cls)), 0)
    named = getattr(error, "peer", None)
    if named is None:  # an abort by the caller: the first rank it said is gone (the peers' closes skip it too)
        named = next(iter(getattr(error, "gone", ())), -1)
    return ABORT_BODY.pack(code, named) + str(error).encode()[:MAX_CONTROL_BYTES - ABORT_BODY.size]


def abort_error(rank: int, peer: int, body: bytes) -> CollectiveError:
    """The error ``rank`` raises when ``peer`` sent an ABORT frame with payload ``body``."""
    if len(body) < ABORT_BODY.size:
        raise ProtocolError(f"short ABORT payload from rank {peer}: {len(body)} bytes")
    code, lost = ABORT_BODY.unpack_from(body)
    msg = f"rank {rank}: rank {peer} aborted the job: {body[ABORT_BODY.size:].decode(errors='replace')}"
    if code == 2:
        return PeerLostError(msg, peer=lost, rank=rank)
    if code == 4:
        return IntegrityError(msg, peer=lost, rank=rank)
    if code == 0 and lost >= 0:
        return AbortedError(msg, gone=(lost,), rank=rank)
    cls = {1: MismatchError, 3: CollectiveTimeoutError}.get(code, AbortedError)
    return cls(msg, rank=rank)


@attrs.frozen(kw_only=True)
class Hello:
    status: int
    job: int
    rank: int
    world: int

    def pack(self) -> bytes:
        return HELLO.pack(HELLO_MAGIC, WIRE_VERSION, self.status, self.job, self.rank, self.world, 0)

    @classmethod
    def parse(cls, data: bytes) -> Hello:
        status, job, rank, world, _ = unpack_hello(HELLO, data)
        return cls(status=status, job=job, rank=rank, world=world)


def unpack_hello(layout: struct.Struct, data: bytes) -> tuple[Any, ...]:
    """The fields after magic and version of a HELLO laid out as ``layout`` (this module's, or the
    authenticated one of ``auth``); ProtocolError for a short one, another magic or another wire version."""
    if len(data) != layout.size:
        raise ProtocolError(f"short hello: {len(data)} of {layout.size} bytes")
    magic, version, *rest = layout.unpack(data)
    if magic != HELLO_MAGIC:
        raise ProtocolError(f"bad hello magic {magic!r}; not an eRDMA peer")
    if version != WIRE_VERSION:
        raise ProtocolError(f"peer speaks wire version {version}, this rank {WIRE_VERSION}")
    return tuple(rest)


class _Fields(NamedTuple):
    kind: int
    job: int
    dtype: int
    opcode: int
    redop: int
    root: int
    group: int
    tag: int
    seq: int
    codec: int
    meta: int
    numel: int
    count: int  # type: ignore[assignment]  # (a field, shadowing tuple.count)
    nbytes: int


OP_FIELDS = slice(_Fields._fields.index("dtype"), _Fields._fields.index("root") + 1)  # dtype, opcode, redop, root
SIZE_FIELDS = slice(_Fields._fields.index("numel"), _Fields._fields.index("count") + 1)  # numel, count


class Header(_Fields):
    """One frame header: a tuple, the cheapest Python object to build once per message and parse once per
    frame. Built with keywords (``make_header`` takes the fields in order, for the hot path). ``key``
    (group, seq, tag) matches a message to its receive."""

    __slots__ = ()

    def __new__(cls, *, kind: int, job: int, dtype: int = 0, opcode: int = 0, redop: int = 0, root: int = NO_ROOT,
                group: int = 0, tag: int = 0, seq: int = 0, codec: int = RAW, meta: int = 0, numel: int = 0,
                count: int = 0, nbytes: int = 0) -> Header:
        return _new(cls, (kind, job, dtype, opcode, redop, root, group, tag, seq, codec, meta, numel, count, nbytes))

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.group, self.seq, self.tag)

    def pack(self) -> bytes:
        return _pack(FRAME_MAGIC, self[0], self[2], self[3], self[4], self[1] & 0xFFFFFFFF, *self[5:])

    @classmethod
    def parse(cls, data: bytes | memoryview) -> Header:
        if len(data) != FRAME.size:
            raise ProtocolError(f"short frame header: {len(data)} of {FRAME.size} bytes")
        magic, kind, dtype, opcode, redop, job, root, group, tag, seq, codec, meta, numel, count, nbytes = _unpack(data)
        if not (magic == FRAME_MAGIC and kind == DATA and meta <= nbytes <= MAX_PAYLOAD):  # the common case
            _check(magic, kind, meta, nbytes)
        return _new(cls, (kind, job, dtype, opcode, redop, root, group, tag, seq, codec, meta, numel, count, nbytes))


def _check(magic: bytes, kind: int, meta: int, nbytes: int) -> None:
    """Raise ProtocolError for a header that is not a well-formed frame (all but a plain DATA frame come here)."""
    if magic != FRAME_MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r}")
    if not DATA <= kind <= PULLED:
        raise ProtocolError(f"unknown frame kind {kind}")
    if nbytes > MAX_PAYLOAD:
        raise ProtocolError(f"frame payload of {nbytes} bytes exceeds {MAX_PAYLOAD}")
    if meta > nbytes:
        raise ProtocolError(f"frame says {meta} bytes of codec metadata in a {nbytes}-byte payload")
    if kind != DATA and nbytes > MAX_CONTROL_BYTES:
        raise ProtocolError(f"control frame (kind {kind}) of {nbytes} bytes exceeds {MAX_CONTROL_BYTES}")
    if kind == PULL and nbytes != LENT.size:
        raise ProtocolError(f"PULL frame of {nbytes} bytes; its payload is {LENT.size}")


def make_header(fields: tuple[int, ...]) -> Header:
    """A header from its 14 fields in declaration order (kind, job, dtype, opcode, redop, root, group, tag, seq,
    codec, meta, numel, count, nbytes)."""
    return _new(Header, fields)


_pack, _unpack, _new = FRAME.pack, FRAME.unpack, tuple.__new__


def control(kind: int, job: int, *, seq: int = 0, nbytes: int = 0) -> Header:
    """An ABORT, BYE or PULLED header."""
    return Header(kind=kind, job=job, seq=seq, nbytes=nbytes)
