"""The NACA header: its layout, round trips, and defensive parsing of whatever arrives (fuzzed)."""

from __future__ import annotations

import random

import pytest
from erdma_naca import header as H
from erdma_naca.aggregator import Aggregator

KEY = bytes(range(32))


def test_layout_is_88_bytes_and_pinned() -> None:
    assert H.LAYOUT.size == 88 and H.VERSION == 2
    assert (H.JOIN, H.JOIN_OK, H.REJECT, H.DATA, H.RESULT, H.DONE, H.PENDING, H.LEAVE, H.ERROR, H.CHALLENGE) == \
        tuple(range(1, 11))
    assert (H.ALLREDUCE, H.BROADCAST, H.REDUCE_SCATTER) == (1, 2, 3)
    h = H.Header(H.DATA, op=H.ALLREDUCE, dtype=3, redop=1, job=0x1122334455667788, group=5, message=9, seq=10,
                 offset=16, total=64, bitmap=4, rank=2, size=4, count=8)
    d = H.pack(h, b"\x01" * 32, KEY)
    assert d[:2] == b"NA" and d[2] == H.VERSION and d[3] == H.DATA
    assert int.from_bytes(d[8:16], "little") == 0x1122334455667788
    assert len(d) == 88 + 32 + H.TAG_BYTES
    assert int.from_bytes(H.pack(h._replace(counter=2**40 + 3), b"", KEY)[80:88], "little") == 2**40 + 3


def test_round_trip() -> None:
    h = H.Header(H.RESULT, op=H.REDUCE_SCATTER, dtype=7, redop=4, flags=H.RETRY, job=1, group=2, status=3,
                 message=4, seq=5, offset=6, total=100, bitmap=0b1011, rank=H.NO_RANK, size=4, root=H.NO_RANK,
                 count=10, counter=77)
    d = H.pack(h, b"x" * 40, KEY)
    assert H.peek(d) == h._replace(length=40)
    assert bytes(H.verify(d, KEY)) == b"x" * 40


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d[:50], "shorter than a header"),
    (lambda d: b"XX" + d[2:], "magic"),
    (lambda d: d[:2] + bytes([9]) + d[3:], "version 9"),
    (lambda d: d[:3] + bytes([77]) + d[4:], "kind 77"),
    (lambda d: d + b"\0", "does not match"),
    (lambda d: d[:4] + bytes([9]) + d[5:], "op 9"),
])
def test_malformed_is_named(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    d = H.pack(H.Header(H.DATA, op=1, dtype=3, redop=1, job=1, total=4, rank=0, size=2, count=4), b"a" * 16, KEY)
    with pytest.raises(H.Malformed, match=message):
        H.peek(mutate(d))


def test_rank_and_range_checked() -> None:
    bad_rank = H.pack(H.Header(H.DATA, op=1, job=1, rank=5, size=4, total=4, count=4), b"", KEY)
    with pytest.raises(H.Malformed, match="rank 5 of size 4"):
        H.peek(bad_rank)
    outside = H.pack(H.Header(H.DATA, op=1, job=1, rank=0, size=2, offset=3, total=4, count=4), b"", KEY)
    with pytest.raises(H.Malformed, match="outside the buffer"):
        H.peek(outside)


def test_tag_binds_header_and_payload() -> None:
    d = bytearray(H.pack(H.Header(H.DATA, op=1, job=1, rank=0, size=2, total=4, count=4), b"p" * 16, KEY))
    H.verify(bytes(d), KEY)
    with pytest.raises(H.Malformed, match="bad tag"):
        H.verify(bytes(d), bytes(32))
    for at in (20, 85):  # a header field, a payload byte
        flipped = bytearray(d)
        flipped[at] ^= 1
        with pytest.raises(H.Malformed, match="bad tag"):
            H.verify(bytes(flipped), KEY)


def test_fuzz_parser_and_node_never_crash() -> None:
    """Random datagrams, truncations and bit flips of valid ones: peek raises only Malformed, and the node
    answers only with REJECTs (never a result, never an exception)."""
    rng = random.Random(1234)
    agg = Aggregator(b"s" * 32, slots=64, job_slots=16)
    valid = [H.pack(H.Header(k, op=1, dtype=3, redop=1, job=7, total=8, rank=1, size=2, count=8,
                             status=4), b"\0" * (32 if k == H.DATA else H.JOIN_PAYLOAD if k == H.JOIN else 0), KEY)
             for k in (H.DATA, H.JOIN, H.LEAVE, H.RESULT)]
    for i in range(20000):
        if i % 3 == 0:
            d = rng.randbytes(rng.randrange(0, 200))
        else:
            d = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 6)):
                d[rng.randrange(len(d))] = rng.randrange(256)
            d = bytes(d[:rng.randrange(len(d) + 1)]) if i % 3 == 2 else bytes(d)
        try:
            H.peek(d)
        except H.Malformed:
            pass
        for _, out in agg.handle(d, ("127.0.0.1", 9), 0.0):
            assert H.peek(out).kind == H.REJECT
    assert not agg.jobs
