"""The eRDMA wire format, written down once. All integers little-endian.

HELLO (sent by the dialling rank, echoed by the accepting rank with ``status``), 32 bytes::

    magic  4s  b"ERDH"
    version H  WIRE_VERSION
    status  H  0 = request, 1 = accepted, 2 = rejected
    job     Q  job id (from the rendezvous store, or a hash of security.job_token)
    rank    I  sender's global rank
    world   I  world size
    spare   Q  0

FRAME header, 44 bytes, followed by ``nbytes`` of payload::

    magic  4s  b"ERDF"
    kind    B  1 = DATA, 2 = ABORT (payload: error code, lost peer, UTF-8 reason), 3 = BYE (closing)
    dtype   B  erdma_core.dtypes code (0 when not a typed payload)
    opcode  B  OPCODES code of the collective (0 for ABORT)
    flags   B  ReduceOp code of the collective (0: none)
    job     I  low 32 bits of the job id
    group   I  process-group id (bit 31 set: point-to-point send/recv)
    seq     Q  collective sequence number in the group (send/recv: the user tag)
    tag     I  message index inside the collective
    numel   Q  element count every rank must agree on (0: not checked)
    nbytes  Q  payload length
"""

from __future__ import annotations

import struct

import attrs

from ..errors import AbortedError, CollectiveError, CollectiveTimeoutError, MismatchError, PeerLostError, ProtocolError

WIRE_VERSION = 1
HELLO = struct.Struct("<4sHHQIIQ")
HELLO_MAGIC = b"ERDH"
FRAME = struct.Struct("<4sBBBBIIQIQQ")
FRAME_MAGIC = b"ERDF"
DATA, ABORT, BYE = 1, 2, 3
HELLO_REQUEST, HELLO_ACCEPTED, HELLO_REJECTED = 0, 1, 2
P2P_GROUP_BIT = 1 << 31
MAX_PAYLOAD = 1 << 40
OPCODES = {name: i + 1 for i, name in enumerate((
    "allreduce", "broadcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter", "alltoall",
    "barrier", "send", "recv", "header",
))}
OPNAMES = {v: k for k, v in OPCODES.items()}
ABORT_BODY = struct.Struct("<Bi")  # ABORT payload: error class code, lost peer (or -1), then the UTF-8 reason
_ABORT_CODES: dict[type[CollectiveError], int] = {MismatchError: 1, PeerLostError: 2, CollectiveTimeoutError: 3}


def abort_body(error: BaseException) -> bytes:
    """The payload of an ABORT frame telling peers why this rank gave up."""
    code = next((c for cls, c in _ABORT_CODES.items() if isinstance(error, cls)), 0)
    return ABORT_BODY.pack(code, getattr(error, "peer", -1)) + str(error).encode()


def abort_error(rank: int, peer: int, body: bytes) -> CollectiveError:
    """The error ``rank`` raises when ``peer`` sent an ABORT frame with payload ``body``."""
    if len(body) < ABORT_BODY.size:
        raise ProtocolError(f"short ABORT payload from rank {peer}: {len(body)} bytes")
    code, lost = ABORT_BODY.unpack_from(body)
    msg = f"rank {rank}: rank {peer} aborted the job: {body[ABORT_BODY.size:].decode(errors='replace')}"
    if code == 2:
        return PeerLostError(msg, peer=lost, rank=rank)
    cls = {1: MismatchError, 3: CollectiveTimeoutError}.get(code, AbortedError)
    return cls(msg, rank=rank)


@attrs.frozen
class Hello:
    status: int
    job: int
    rank: int
    world: int

    def pack(self) -> bytes:
        return HELLO.pack(HELLO_MAGIC, WIRE_VERSION, self.status, self.job, self.rank, self.world, 0)

    @classmethod
    def parse(cls, data: bytes) -> Hello:
        if len(data) != HELLO.size:
            raise ProtocolError(f"short hello: {len(data)} of {HELLO.size} bytes")
        magic, version, status, job, rank, world, _ = HELLO.unpack(data)
        if magic != HELLO_MAGIC:
            raise ProtocolError(f"bad hello magic {magic!r}; not an eRDMA peer")
        if version != WIRE_VERSION:
            raise ProtocolError(f"peer speaks wire version {version}, this rank {WIRE_VERSION}")
        return cls(status, job, rank, world)


@attrs.frozen
class Header:
    kind: int
    dtype: int
    opcode: int
    flags: int
    job: int
    group: int
    seq: int
    tag: int
    numel: int
    nbytes: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.group, self.seq, self.tag)

    def pack(self) -> bytes:
        return FRAME.pack(FRAME_MAGIC, self.kind, self.dtype, self.opcode, self.flags, self.job & 0xFFFFFFFF,
                          self.group, self.seq, self.tag, self.numel, self.nbytes)

    @classmethod
    def parse(cls, data: bytes | memoryview) -> Header:
        if len(data) != FRAME.size:
            raise ProtocolError(f"short frame header: {len(data)} of {FRAME.size} bytes")
        magic, kind, dtype, opcode, flags, job, group, seq, tag, numel, nbytes = FRAME.unpack(data)
        if magic != FRAME_MAGIC:
            raise ProtocolError(f"bad frame magic {bytes(magic)!r}")
        if kind not in (DATA, ABORT, BYE):
            raise ProtocolError(f"unknown frame kind {kind}")
        if nbytes > MAX_PAYLOAD:
            raise ProtocolError(f"frame payload of {nbytes} bytes exceeds {MAX_PAYLOAD}")
        return cls(kind, dtype, opcode, flags, job, group, seq, tag, numel, nbytes)
