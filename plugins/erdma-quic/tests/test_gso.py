"""UDP GSO per path (``erdma_quic.gso``): a path takes GSO messages only once the peer's port answered every
datagram of a probe sent as one; an unanswered or half-answered path sends one by one and is tried again
later; a proven path is proven again; answers are rate-limited and only the round's own count. Then two ranks
on loopback: their paths are proven and the receiver's socket gets GSO-sent runs (coalesced by GRO)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from erdma_quic import gso
from erdma_quic.gso import GsoPaths
from helpers import MemoryStore, options, start

from erdma_core.sdk import Header
from erdma_core.toolkit import DATA

PEER = ("10.0.0.2", 47000)
SIZE = 1452


def _nonces():
    counter = itertools.count(1)
    return lambda n: next(counter).to_bytes(n, "big")


def _segments(probe: bytes) -> list[bytes]:
    assert len(probe) == gso.SEGMENTS * SIZE
    return [probe[i:i + SIZE] for i in range(0, len(probe), SIZE)]


def _answer_all(sender: GsoPaths, answerer: GsoPaths, probe: bytes, now: float, keep: int | None = None) -> None:
    for seg in _segments(probe)[:keep]:
        answer = answerer.on_datagram(seg, now)
        assert answer is not None and len(answer) < len(seg)
        assert sender.on_datagram(answer, now) is None


def test_a_path_takes_gso_once_every_datagram_of_its_probe_came_back():
    verdicts = []
    a, b = GsoPaths(lambda addr, ok: verdicts.append((addr, ok)), random=_nonces()), GsoPaths()
    use, probe = a.use(PEER, SIZE, 0.0)
    assert not use and probe is not None and probe.startswith(gso.PROBE)
    assert a.use(PEER, SIZE, 0.01) == (False, None)  # the round's next probe is not due yet
    _answer_all(a, b, probe, 0.02)
    assert a.use(PEER, SIZE, 0.03) == (True, None)
    assert a.proven() == [PEER] and verdicts == [(PEER, True)]


@pytest.mark.parametrize("keep", [0, 1])
def test_a_path_that_answers_no_probe_whole_sends_one_by_one_and_is_tried_again_later(keep: int):
    verdicts = []
    a, b = GsoPaths(lambda addr, ok: verdicts.append((addr, ok)), random=_nonces()), GsoPaths()
    probes, t = [], 0.0
    while t < (gso.TRIES + 1) * gso.SPACING:
        use, probe = a.use(PEER, SIZE, t)
        assert not use
        if probe is not None:
            probes.append(probe)
            _answer_all(a, b, probe, t, keep)  # keep=1: one datagram of each GSO message came back
        t += 0.05
    assert len(probes) == gso.TRIES
    assert a.use(PEER, SIZE, t) == (False, None)
    assert verdicts == [(PEER, False)] and a.proven() == []
    assert a.use(PEER, SIZE, t + gso.RETRY - 1) == (False, None)
    use, probe = a.use(PEER, SIZE, t + gso.RETRY + 0.01)  # a minute later: a new round
    assert not use and probe is not None
    _answer_all(a, b, probe, t + gso.RETRY + 0.02)
    assert a.use(PEER, SIZE, t + gso.RETRY + 0.03) == (True, None)
    assert verdicts == [(PEER, False), (PEER, True)]


def test_a_proven_path_keeps_gso_while_it_is_proven_again_and_loses_it_when_that_fails():
    a, b = GsoPaths(random=_nonces()), GsoPaths()
    _, probe = a.use(PEER, SIZE, 0.0)
    _answer_all(a, b, probe, 0.0)
    assert a.use(PEER, SIZE, 0.1) == (True, None)
    use, probe = a.use(PEER, SIZE, 0.1 + gso.RECHECK)
    assert use and probe is not None  # GSO goes on during the re-check
    start, end = 0.1 + gso.RECHECK, 0.1 + gso.RECHECK + (gso.TRIES + 1) * gso.SPACING
    for k in range(1, 39):
        assert a.use(PEER, SIZE, start + k * 0.05)[0]
    assert a.use(PEER, SIZE, end + 0.01) == (False, None)  # nothing came back: one by one


def test_answers_of_another_round_or_forged_ones_do_not_count():
    a, b = GsoPaths(random=_nonces()), GsoPaths()
    _, first = a.use(PEER, SIZE, 0.0)
    t = 0.0
    while a.use(PEER, SIZE, t)[0] is False and t < gso.TRIES * gso.SPACING + gso.SPACING:
        t += 0.05  # the first round goes unanswered
    late = [b.on_datagram(seg, t) for seg in _segments(first)]  # its answers, too late for it
    _, second = a.use(PEER, SIZE, t + gso.RETRY)
    assert second is not None and second != first
    nonce = _segments(second)[0][len(gso.PROBE):len(gso.PROBE) + gso.NONCE]
    forged = [gso.ANSWER + bytes(gso.NONCE) + bytes([i]) for i in range(gso.SEGMENTS)]
    for answer in [*late, *forged, gso.ANSWER + nonce + b"\x07", gso.ANSWER + nonce[:4]]:
        assert a.on_datagram(answer, t + gso.RETRY) is None
    assert a.use(PEER, SIZE, t + gso.RETRY + 0.01) == (False, None)
    assert a.on_datagram(b"\x00short", 0.0) is None and a.on_datagram(b"\x00" * 100, 0.0) is None
    small = _segments(second)[0][:gso.MIN_PROBE - 1]  # a probe shorter than QUIC's smallest datagram: no answer
    assert b.on_datagram(small, t) is None and b.on_datagram(_segments(second)[0], t) is not None


def test_a_port_answers_at_most_its_rate_of_probes():
    b = GsoPaths()
    seg = _segments(GsoPaths(random=_nonces()).use(PEER, SIZE, 0.0)[1])[0]
    answered = sum(b.on_datagram(seg, 5.0) is not None for _ in range(1000))
    assert answered == int(gso.ANSWERS_PER_SECOND)
    assert b.on_datagram(seg, 5.0) is None
    assert b.on_datagram(seg, 5.1) is not None  # a tenth of a second refills a tenth of the rate


def _header(seq: int, n: int) -> Header:
    return Header(kind=DATA, job=78, dtype=9, opcode=1, seq=seq, numel=n, count=n, nbytes=n)


@pytest.mark.parametrize("on", [True, False])
def test_two_ranks_prove_their_path_and_send_runs_as_gso_messages(on: bool):
    store = MemoryStore()
    ranks = [start(r, 2, store, 78, options(secret="gso", gso=on), timeout=20) for r in range(2)]
    for _, th, errors in ranks:
        th.join(30)
        assert not errors, errors
    a, b = (t for t, _, _ in ranks)
    try:
        x = np.random.default_rng(7).integers(0, 256, 4 << 20, dtype=np.uint8)
        for seq in range(3):
            out = np.zeros_like(x)
            rb = b.irecv(0, _header(seq, x.size), memoryview(out))
            a.isend(1, _header(seq, x.size), memoryview(x), time.monotonic() + 30)
            assert b.wait(rb, time.monotonic() + 30)
            assert np.array_equal(out, x)
        proven = a.endpoint.run_sync(a.endpoint.gso_paths.proven)
        assert len(proven) == (1 if on else 0), proven
        demux = getattr(b.mesh.connection, "demux", None)
        if demux is not None:  # the compiled engine's receive path splits what GRO coalesced
            assert (demux.coalesced > 0) == on, demux.coalesced
    finally:
        for t in (a, b):
            t.close()
