"""Property-based fuzzing of every parser a peer's bytes reach: the frame header, a byte stream of frames,
the HELLO handshake, the store's handshake and requests, ABORT payloads: nothing but the protocol's own
error (ProtocolError) comes out, nothing is accepted without the secret, and no allocation exceeds the stated
limits. ``make test`` runs the same 2,000 cases per parser every time (derandomized: a regression set);
``make fuzz`` runs ``ERDMA_FUZZ_EXAMPLES`` (100,000 there) new random ones per parser."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from erdma_core import AuthenticationError, CollectiveError, ProtocolError, wire
from erdma_core.discovery import store
from erdma_core.security import auth
from erdma_core.transport.frames import FrameInbox, StreamReader
from erdma_core.transport.mailbox import Mailbox
from erdma_core.wire import ABORT, BYE, DATA, FRAME, FRAME_MAGIC, MAX_CONTROL_BYTES, MAX_PAYLOAD, Header, abort_error

_EXPLORE = os.environ.get("ERDMA_FUZZ_EXAMPLES")  # set: that many new random cases per parser (make fuzz)
CASES = settings(max_examples=int(_EXPLORE or 2_000), deadline=None, suppress_health_check=list(HealthCheck),
                 derandomize=_EXPLORE is None)
JOB = 0x5EC
LIMIT = 1 << 20  # the early-bytes budget the stream fuzz runs under


def _header_fields() -> st.SearchStrategy[bytes]:
    """Frame headers that pass the magic check most of the time, with every field drawn from its whole range
    and from the edges that matter."""
    u8, u32, u64 = (st.integers(0, 2**b - 1) for b in (8, 32, 64))
    return st.builds(
        lambda magic, kind, dtype, opcode, redop, job, root, group, tag, seq, codec, meta, numel, count, nbytes:
        FRAME.pack(magic, kind, dtype, opcode, redop, job, root, group, tag, seq, codec, meta, numel, count, nbytes),
        st.sampled_from([FRAME_MAGIC, FRAME_MAGIC, FRAME_MAGIC, b"ERDX"]), st.sampled_from([DATA, ABORT, BYE, 0, 9]) | u8,
        u8, u8, u8, st.sampled_from([JOB, JOB + 1]) | u32, st.sampled_from([0, wire.NO_ROOT]) | u32,
        st.integers(0, 3) | u32, st.integers(0, 3) | u32,
        st.integers(0, 3) | u64, st.sampled_from([0, 0, 1]) | u32, st.integers(0, 64) | u32, u64, u64,
        st.integers(0, 256) | st.sampled_from([LIMIT, LIMIT + 1, MAX_PAYLOAD, MAX_PAYLOAD + 1]) | u64,
    )


@CASES
@given(st.one_of(_header_fields(), st.binary(min_size=0, max_size=FRAME.size + 4)))
def test_frame_header(data):
    try:
        h = Header.parse(data)
    except ProtocolError:
        return
    assert h.nbytes <= MAX_PAYLOAD and h.meta <= h.nbytes
    assert h.kind == DATA or h.nbytes <= MAX_CONTROL_BYTES
    assert Header.parse(h.pack()) == h._replace(job=h.job & 0xFFFFFFFF)


@CASES
@given(st.lists(st.tuples(_header_fields(), st.binary(max_size=300)), max_size=4), st.integers(1, 97))
def test_stream_of_frames(frames, cut):
    """A peer's byte stream, split into reads of ``cut`` bytes: only ProtocolError (or a collective error an
    ABORT carries) comes out, and the mailbox never holds more than its budget."""
    box = Mailbox(0, JOB, early_bytes=LIMIT)
    reader = StreamReader(FrameInbox(0, 1, box))
    stream = b"".join(head + body for head, body in frames)
    try:
        for i in range(0, len(stream), cut):
            piece = stream[i:i + cut]
            while piece:
                buf = reader.buffer()
                n = min(len(buf), len(piece))
                buf[:n] = piece[:n]
                reader.advance(n)
                piece = piece[n:]
                assert sum(box._early_bytes.values()) <= LIMIT
    except ProtocolError:
        pass
    assert sum(box._early_bytes.values()) <= LIMIT


def _hello_bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(min_size=auth.HELLO.size, max_size=auth.HELLO.size),
        st.builds(lambda status, job, rank, world, nonce: auth.pack_hello(status, job, rank, world, nonce),
                  st.integers(0, 20) | st.integers(0, 2**16 - 1), st.sampled_from([JOB, JOB ^ 1]) | st.integers(0, 2**64 - 1),
                  st.integers(0, 4) | st.integers(0, 2**32 - 1), st.sampled_from([2, 3]) | st.integers(0, 2**32 - 1),
                  st.binary(min_size=auth.NONCE, max_size=auth.NONCE)),
    )


@CASES
@given(_hello_bytes(), st.binary(min_size=auth.MAC, max_size=auth.MAC))
def test_hello_acceptor_accepts_nobody_without_the_secret(hello, proof):
    key = auth.job_key(b"secret", JOB)
    hs = auth.Accepting(key, JOB, 0, 2, range(1, 2), lambda rank, lane, lanes: None)
    try:
        reply = hs.feed(hello)
        assert auth.parse_hello(reply[:auth.HELLO.size])[0] in (auth.CHALLENGE, *auth.REASONS)
        if hs.need:
            hs.feed(proof)
    except ProtocolError:
        return
    assert hs.rank_proven is None and hs.need == 0


@CASES
@given(_hello_bytes(), st.binary(min_size=auth.MAC, max_size=auth.MAC))
def test_hello_dialler_trusts_nobody_without_the_secret(reply, mac):
    hs = auth.Dialling(auth.job_key(b"secret", JOB), JOB, 1, 0, 2)
    hs.first()
    try:
        hs.on_challenge(reply + mac)
        hs.on_verdict(auth.pack_hello(auth.ACCEPTED, JOB, 0, 2))
    except (AuthenticationError, ProtocolError):
        return
    pytest.fail("the dialler accepted an acceptor that does not know the secret")


@CASES
@given(st.binary(min_size=auth.STORE_HELLO.size, max_size=auth.STORE_HELLO.size)
       | st.builds(lambda n: auth.STORE_HELLO.pack(auth.STORE_MAGIC, auth.STORE_VERSION, n),
                   st.binary(min_size=auth.NONCE, max_size=auth.NONCE)),
       st.binary(min_size=auth.MAC, max_size=auth.MAC))
def test_store_handshake_accepts_nobody_without_the_secret(hello, proof):
    hs = auth.StoreServer(auth.store_key(b"secret"))
    try:
        hs.on_hello(hello)
    except ProtocolError:
        return
    assert not hs.on_proof(proof)


@CASES
@given(st.builds(lambda op, timeout, klen, vlen: struct.pack("<BdII", op, timeout, klen, vlen),
                 st.integers(0, 255), st.floats(allow_nan=True, allow_infinity=True), st.integers(0, 2**32 - 1),
                 st.integers(0, 2**32 - 1))
       | st.binary(min_size=17, max_size=17))
def test_store_request(head):
    try:
        op, timeout, klen, vlen = store.parse_request(head)
    except ProtocolError:
        return
    assert op in (1, 2, 3, 4) and 0 <= timeout <= 7 * 24 * 3600
    assert klen <= store.MAX_KEY and vlen <= store.MAX_VALUE


@CASES
@given(st.binary(max_size=64) | st.builds(lambda code, lost, text: struct.pack("<Bi", code, lost) + text,
                                           st.integers(0, 255), st.integers(-(2**31), 2**31 - 1),
                                           st.binary(max_size=40)))
def test_abort_payload(body):
    try:
        err = abort_error(0, 1, body)
    except ProtocolError:
        return
    assert isinstance(err, CollectiveError) and str(err).startswith("rank 0: rank 1 aborted the job")
