"""Every number on the wire, pinned: a change here breaks compatibility with every rank already deployed,
so it must be deliberate (and bump WIRE_VERSION)."""

from __future__ import annotations

import pytest

from erdma_core import ReduceOp, wire
from erdma_core.errors import (
    AbortedError,
    CollectiveTimeoutError,
    IntegrityError,
    MismatchError,
    PeerLostError,
    ProtocolError,
)
from erdma_core.protocol import dtypes
from erdma_core.protocol.ops import COLLECTIVES, OPS
from erdma_core.security import auth, integrity
from erdma_core.wire import FRAME, HELLO, Header, Hello


def test_layouts_and_sizes():
    assert wire.WIRE_VERSION == 5
    assert (HELLO.format, HELLO.size) == ("<4sHHQIIQ", 32)
    assert (FRAME.format, FRAME.size) == ("<4sBBBBIIIIQIIQQQ", 64)
    assert wire.NO_ROOT == 0xFFFFFFFF
    assert (auth.HELLO.format, auth.HELLO.size, auth.NONCE, auth.MAC) == ("<4sHHQIIHH16s", 44, 16, 32)
    assert auth.MAX_LANES == 64
    assert (auth.REQUEST, auth.CHALLENGE, auth.ACCEPTED) == (0, 1, 2)
    assert (auth.WRONG_JOB, auth.WRONG_WORLD, auth.UNEXPECTED_RANK, auth.DUPLICATE_RANK, auth.BAD_PROOF,
            auth.WRONG_LANES) == (10, 11, 12, 13, 14, 15)
    assert (auth.STORE_HELLO.format, auth.STORE_MAGIC, auth.STORE_VERSION) == ("<4sH16s", b"ERDS", 1)
    assert (wire.HELLO_MAGIC, wire.FRAME_MAGIC) == (b"ERDH", b"ERDF")
    assert (wire.ABORT_BODY.format, wire.MAX_CONTROL_BYTES) == ("<Bi", 65536)
    assert (integrity.SEAL.format, integrity.SEAL.size, integrity.TAG, integrity.WINDOW) == ("<Q16s", 24, 16, 64)


def test_codes():
    assert (wire.DATA, wire.ABORT, wire.BYE, wire.PULL, wire.PULLED) == (1, 2, 3, 4, 5)
    assert (wire.LENT.format, wire.LENT.size) == ("<QQQ", 24)
    assert (wire.HELLO_REQUEST, wire.HELLO_ACCEPTED, wire.HELLO_REJECTED) == (0, 1, 2)
    assert wire.RAW == 0 and wire.P2P_GROUP_BIT == 1 << 31
    assert {name: op.code for name, op in OPS.items()} == {
        "allreduce": 1, "broadcast": 2, "reduce": 3, "allgather": 4, "gather": 5, "scatter": 6, "reduce_scatter": 7,
        "alltoall": 8, "barrier": 9, "send": 10}
    assert COLLECTIVES == ("allreduce", "broadcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter",
                           "alltoall", "barrier")
    assert {op.name: op.code for op in ReduceOp} == {"SUM": 1, "PROD": 2, "MIN": 3, "MAX": 4, "AVG": 5, "BAND": 6,
                                                     "BOR": 7, "BXOR": 8}
    assert {n: dtypes.code_of(n) for n in dtypes.NAMES} == {
        "float16": 1, "bfloat16": 2, "float32": 3, "float64": 4, "int8": 5, "int16": 6, "int32": 7, "int64": 8,
        "uint8": 9, "bool": 10}
    assert {cls: code for cls, code in wire.ABORT_CODES.items()} == {MismatchError: 1, PeerLostError: 2,
                                                                      CollectiveTimeoutError: 3, IntegrityError: 4}
    assert (wire.codec_id("fp16"), wire.codec_id("none")) == (0x31A79B2E, 0x2C281659)


def test_header_round_trip_keeps_every_field():
    h = Header(kind=wire.DATA, job=0xABCDEF0123, dtype=3, opcode=7, redop=2, root=6, group=5 | wire.P2P_GROUP_BIT,
               tag=9, seq=2**40, codec=0xDEADBEEF, meta=12, numel=99, count=33, nbytes=123)
    back = Header.parse(h.pack())
    assert back == Header(kind=wire.DATA, job=0xABCDEF0123 & 0xFFFFFFFF, dtype=3, opcode=7, redop=2, root=6,
                          group=5 | wire.P2P_GROUP_BIT, tag=9, seq=2**40, codec=0xDEADBEEF, meta=12, numel=99,
                          count=33, nbytes=123)
    assert Header(kind=wire.DATA, job=1).root == wire.NO_ROOT
    assert Hello.parse(Hello(status=1, job=7, rank=3, world=8).pack()) == Hello(status=1, job=7, rank=3, world=8)
    with pytest.raises(ProtocolError, match="wire version"):
        Hello.parse(HELLO.pack(b"ERDH", 1, 0, 0, 0, 0, 0))


@pytest.mark.parametrize("fields,message", [
    ({"kind": 9}, "unknown frame kind 9"),
    ({"kind": 0}, "unknown frame kind 0"),
    ({"kind": wire.PULL, "nbytes": 25}, "PULL frame of 25 bytes; its payload is 24"),
    ({"nbytes": 5, "meta": 6}, "6 bytes of codec metadata in a 5-byte payload"),
    ({"kind": wire.ABORT, "nbytes": 70000}, "control frame (kind 2) of 70000 bytes exceeds 65536"),
    ({"nbytes": (1 << 40) + 1}, "exceeds 1099511627776"),
])
def test_bad_headers_are_refused(fields, message):
    data = Header(**{"kind": wire.DATA, "job": 1, **fields}).pack()
    with pytest.raises(ProtocolError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Header.parse(data)


def test_abort_body_carries_the_error_class_and_the_lost_peer():
    err = wire.abort_error(0, 2, wire.abort_body(PeerLostError("rank 2: lost rank 3", peer=3)))
    assert isinstance(err, PeerLostError) and err.peer == 3 and "rank 2 aborted the job: rank 2: lost rank 3" in str(err)
    assert isinstance(wire.abort_error(0, 1, wire.abort_body(MismatchError("m"))), MismatchError)
    err = wire.abort_error(0, 1, wire.abort_body(IntegrityError("rank 1: integrity check failed on ... rank 2", peer=2)))
    assert isinstance(err, IntegrityError) and err.peer == 2
    assert isinstance(wire.abort_error(0, 1, wire.abort_body(ValueError("v"))), AbortedError)


def test_constructors_take_keywords_only():
    from erdma_core.engine.executor import Op
    from erdma_core.transport.base import TransportContext

    with pytest.raises(TypeError):
        Header(1, 5)  # type: ignore[misc]
    with pytest.raises(TypeError):
        Hello(1, 7, 3, 8)  # type: ignore[misc]
    with pytest.raises(TypeError):
        Op("allreduce", 1, "float32", 3, 10, 7, 0, 1, None, 1.0, 100, (0, 1), 0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        TransportContext(0, 2, None, 7, 1.0)  # type: ignore[misc]
