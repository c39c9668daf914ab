"""The NACA header (the IETF draft's R1): one fixed layout, versioned, written down once. Every datagram
between a rank and an aggregation node is this header, a payload of ``length`` bytes and a 16-byte tag.
All integers little-endian::

    magic    2s  b"NA"
    version  B   VERSION (a datagram of another version is dropped)
    kind     B   JOIN 1, JOIN_OK 2, REJECT 3, DATA 4, RESULT 5, DONE 6, PENDING 7, LEAVE 8, ERROR 9, CHALLENGE 10
    op       B   ALLREDUCE 1, BROADCAST 2, REDUCE_SCATTER 3 (0 for JOIN, JOIN_OK, REJECT, LEAVE, CHALLENGE)
    dtype    B   erdma_core.protocol.dtypes code of the elements
    redop    B   erdma_core ReduceOp code (SUM for AVG: the ranks divide)
    flags    B   NO_DATA 1 (a contribution without elements: broadcast's non-roots), RETRY 2 (a retransmission),
                 GIVE_UP 4 (LEAVE: the rank gave the collective under way up and fails over: the node forgets
                 the job, so that its other ranks, told "unknown job" at their next datagram, fail over too)
    job      Q   job id (the job's 64-bit id, agreed by its ranks)
    group    I   process-group id within the job
    status   I   REJECT/ERROR: a reason code (REASONS); JOIN: slots asked; JOIN_OK: slots granted; PENDING: 0
    message  Q   collective sequence number in the group (the message id)
    seq      Q   chunk sequence number in the job's group, counted across collectives; the slot is
                 seq % slots
    offset   Q   first element of the chunk in the collective's buffer
    total    Q   elements of the collective's buffer (every contributor must agree)
    bitmap   Q   contributor bitmap: DATA, its sender's bit; RESULT/DONE/PENDING, the contributions in
    rank     H   sender's rank in the group (0xFFFF from the node)
    size     H   contributors (the group's size, at most MAX_RANKS)
    root     H   broadcast's root, else 0xFFFF
    spare    H   0
    count    I   elements in this chunk
    length   I   payload bytes that follow
    counter  Q   from a rank: its link's datagram counter (1, 2, ... every datagram a new one, a retransmission
                 too); the node takes each once, within WINDOW below the highest. From the node: the
                 counter of the rank's datagram it answers (0 for results that go to every rank)

The header is 88 bytes (``LAYOUT.size``). The tag is HMAC-SHA256, truncated to 16 bytes, over header and
payload. A rank's JOIN, the node's CHALLENGE and REJECT are tagged with the node's admission key; JOIN_OK with
the job's key; everything else with the job's key for that node (``node_key``: the job's key bound to the
node's identity, which JOIN_OK carries), so a datagram meant for one node is worthless at another.

Joining takes two rounds, so that a recorded JOIN cannot re-point where a node sends a rank's results:
JOIN's payload is a 16-byte nonce, the job's key masked with HMAC(admission key, "wrap" | job | group |
nonce) and a 16-byte cookie (zero at first); the node answers a JOIN without a valid cookie with CHALLENGE
(nonce, then a cookie bound to the JOIN's source address, nonce and the time, valid for 20 s) and keeps
nothing; the rank sends the JOIN again with that cookie, and only then does the node take the job and the
rank's address (JOIN_OK: the nonce, then the node's 16-byte identity). A JOIN's REJECT carries its nonce:
a rank takes only the answer to the JOIN it sent last. A REJECT of DATA for a job the node does not know
(UNKNOWN_JOB) carries no payload (no answer is larger than what caused it) and the DATA's counter. ERROR
carries UTF-8 text.
"""

from __future__ import annotations

import hmac
import struct
from typing import NamedTuple

MAGIC = b"NA"
VERSION = 2
LAYOUT = struct.Struct("<2sBBBBBBQIIQQQQQHHHHIIQ")
TAG_BYTES = 16
MAX_RANKS = 64
NO_RANK = 0xFFFF
MAX_DATAGRAM = 65507  # UDP over IPv4

JOIN, JOIN_OK, REJECT, DATA, RESULT, DONE, PENDING, LEAVE, ERROR, CHALLENGE = range(1, 11)
KINDS = {JOIN: "JOIN", JOIN_OK: "JOIN_OK", REJECT: "REJECT", DATA: "DATA", RESULT: "RESULT", DONE: "DONE",
         PENDING: "PENDING", LEAVE: "LEAVE", ERROR: "ERROR", CHALLENGE: "CHALLENGE"}
NONCE = COOKIE = NODE_ID = 16  # bytes of a JOIN's nonce, a node's cookie, a node's identity
JOIN_PAYLOAD = NONCE + 32 + COOKIE  # nonce, masked job key, cookie
WINDOW = 256  # datagrams a rank's counter may lag the highest the node has taken from it
ALLREDUCE, BROADCAST, REDUCE_SCATTER = 1, 2, 3
OPS = {"allreduce": ALLREDUCE, "broadcast": BROADCAST, "reduce_scatter": REDUCE_SCATTER}
OP_NAMES = {v: k for k, v in OPS.items()}
NO_DATA, RETRY, GIVE_UP = 1, 2, 4

# REJECT and ERROR reason codes
BAD_ADMISSION, NO_SLOTS, JOB_KEY, BAD_JOIN, MISMATCH, UNKNOWN_JOB = range(1, 7)
REASONS = {BAD_ADMISSION: "the node's admission secret was not proved", NO_SLOTS: "the node has no free slots",
           JOB_KEY: "the job is registered with another key", BAD_JOIN: "malformed JOIN",
           MISMATCH: "contributions disagree", UNKNOWN_JOB: "unknown job"}


class Header(NamedTuple):
    kind: int
    op: int = 0
    dtype: int = 0
    redop: int = 0
    flags: int = 0
    job: int = 0
    group: int = 0
    status: int = 0
    message: int = 0
    seq: int = 0
    offset: int = 0
    total: int = 0
    bitmap: int = 0
    rank: int = NO_RANK
    size: int = 0
    root: int = NO_RANK
    count: int = 0
    length: int = 0
    counter: int = 0


class Malformed(ValueError):
    """A datagram that is not a NACA datagram of this version, or whose fields contradict each other."""


def pack(h: Header, payload: bytes | memoryview, key: bytes) -> bytes:
    """Header, payload and tag, ready to send (``h.length`` is set from the payload)."""
    head = LAYOUT.pack(MAGIC, VERSION, h.kind, h.op, h.dtype, h.redop, h.flags, h.job, h.group, h.status,
                       h.message, h.seq, h.offset, h.total, h.bitmap, h.rank, h.size, h.root, 0, h.count,
                       len(payload), h.counter)
    body = head + bytes(payload)
    return body + hmac.digest(key, body, "sha256")[:TAG_BYTES]


def peek(datagram: bytes) -> Header:
    """The header of ``datagram``, checked for shape only (lengths, magic, version, kinds, ranges); the tag
    is not checked: ``verify`` does, with the key the header's job selects. Raises ``Malformed``."""
    if len(datagram) < LAYOUT.size + TAG_BYTES:
        raise Malformed(f"{len(datagram)} bytes, shorter than a header and tag ({LAYOUT.size + TAG_BYTES})")
    f = LAYOUT.unpack_from(datagram)
    if f[0] != MAGIC:
        raise Malformed(f"magic {f[0]!r}, not {MAGIC!r}")
    if f[1] != VERSION:
        raise Malformed(f"version {f[1]}, this is version {VERSION}")
    h = Header(*f[2:18], f[19], f[20], f[21])
    if h.kind not in KINDS:
        raise Malformed(f"kind {h.kind}")
    if len(datagram) != LAYOUT.size + h.length + TAG_BYTES:
        raise Malformed(f"length {h.length} does not match the datagram's {len(datagram)} bytes")
    if h.op and h.op not in OP_NAMES:
        raise Malformed(f"op {h.op}")
    if h.size > MAX_RANKS or (h.rank != NO_RANK and h.rank >= max(h.size, 1)):
        raise Malformed(f"rank {h.rank} of size {h.size} (at most {MAX_RANKS})")
    if h.offset + h.count > h.total and h.kind in (DATA, RESULT):
        raise Malformed(f"chunk [{h.offset}, +{h.count}) outside the buffer of {h.total}")
    return h


def verify(datagram: bytes, key: bytes) -> memoryview:
    """The payload of ``datagram`` if its tag is right for ``key``; raises ``Malformed`` otherwise."""
    body = memoryview(datagram)[:-TAG_BYTES]
    if not hmac.compare_digest(hmac.digest(key, body, "sha256")[:TAG_BYTES], datagram[-TAG_BYTES:]):
        raise Malformed("bad tag (not this job's key)")
    return body[LAYOUT.size:]


def wrap_mask(admission: bytes, job: int, group: int, nonce: bytes) -> bytes:
    """The 32 bytes that mask the job's key in a JOIN (xor)."""
    return hmac.digest(admission, b"wrap" + struct.pack("<QI", job, group) + nonce, "sha256")


def xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def read_secret(path: str) -> bytes:
    """The admission secret in the file ``path`` (surrounding whitespace ignored); ValueError saying what is
    wrong with it."""
    from pathlib import Path

    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(exc.strerror) from None
    if len(secret) < 16:
        raise ValueError(f"it holds {len(secret)} bytes; a secret needs at least 16")
    return secret


def admission_key(secret: bytes) -> bytes:
    """The key JOINs are tagged with, from the node's secret (``erdma naca serve --secret-file``)."""
    return hmac.digest(secret, b"erdma-naca admission", "sha256")


def node_key(job_key: bytes, node_id: bytes) -> bytes:
    """The key a job's datagrams to and from one node are tagged with: the job's key bound to the node's
    identity (JOIN_OK carries it), so that what one node was sent is worthless at another."""
    return hmac.digest(job_key, b"erdma-naca node|" + node_id, "sha256")


def describe(h: Header) -> str:
    op = OP_NAMES.get(h.op, "-")
    return (f"{KINDS.get(h.kind, h.kind)} {op} job {h.job:#x} group {h.group} message {h.message} seq {h.seq} "
            f"rank {h.rank} [{h.offset}, +{h.count}) of {h.total}")
