"""Who drives a rank's QUIC mesh (``driver``): the thread that waits reads, runs timers and sends; a thread
that posts sends its packets itself; the background thread carries on when nobody waits (a send nobody waits
for still arrives whole, with every ACK it needs); two threads waiting at once both get their messages."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers import MemoryStore, options, start

from erdma_core.sdk import Header
from erdma_core.toolkit import DATA

JOB = 77


def _header(seq: int, n: int) -> Header:
    return Header(kind=DATA, job=JOB, dtype=9, opcode=1, seq=seq, numel=n, count=n, nbytes=n)


@pytest.fixture()
def pair():
    store = MemoryStore()
    ranks = [start(r, 2, store, JOB, options(secret="driver"), timeout=20) for r in range(2)]
    for _, th, errors in ranks:
        th.join(30)
        assert not errors, errors
    yield [t for t, _, _ in ranks]
    for t, _, _ in ranks:
        t.close()


def test_round_trips_driven_by_the_waiting_threads_arrive_bit_exact(pair):
    a, b = pair
    rng = np.random.default_rng(5)
    for seq in range(200):
        x = rng.integers(0, 256, 4096, dtype=np.uint8)
        got_b, got_a = np.zeros_like(x), np.zeros_like(x)
        rb = b.irecv(0, _header(seq, x.size), memoryview(got_b))
        a.isend(1, _header(seq, x.size), memoryview(x), time.monotonic() + 10)
        assert b.wait(rb, time.monotonic() + 10)
        ra = a.irecv(1, _header(seq, x.size), memoryview(got_a))
        b.isend(0, _header(seq, x.size), memoryview(got_b), time.monotonic() + 10)
        assert a.wait(ra, time.monotonic() + 10)
        assert np.array_equal(got_a, x)


def test_a_large_send_nobody_waits_for_is_carried_by_the_background_thread(pair):
    """8 MiB is more than QUIC sends before its first ACK: the sender's mesh must read ACKs and send on
    while no thread of that rank waits."""
    a, b = pair
    small = np.zeros(8, np.uint8)
    ra = a.irecv(1, _header(0, 8), memoryview(small))
    b.isend(0, _header(0, 8), memoryview(np.ones(8, np.uint8)), time.monotonic() + 10)
    assert a.wait(ra, time.monotonic() + 10)  # rank 0 has driven its mesh: the background stands back a moment
    x = np.random.default_rng(6).integers(0, 256, 8 << 20, dtype=np.uint8)
    out = np.zeros_like(x)
    rb = b.irecv(0, _header(1, x.size), memoryview(out))
    sent = a.isend(1, _header(1, x.size), memoryview(x), time.monotonic() + 30)
    assert b.wait(rb, time.monotonic() + 30)  # only rank 1 waits
    assert np.array_equal(out, x)
    deadline = time.monotonic() + 10
    while not sent.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent.done() and sent.error is None


def test_two_threads_waiting_on_one_rank_both_get_their_messages(pair):
    a, b = pair
    xs = [np.full(65536, i + 1, np.uint8) for i in range(2)]
    outs = [np.zeros(65536, np.uint8) for _ in range(2)]
    reqs = [b.irecv(0, _header(10 + i, 65536), memoryview(outs[i])) for i in range(2)]
    done: list[bool] = []
    waiters = [threading.Thread(target=lambda r=r: done.append(b.wait(r, time.monotonic() + 20))) for r in reqs]
    for w in waiters:
        w.start()
    time.sleep(0.1)  # both asleep: one drives, the other waits for it
    for i in (1, 0):
        a.isend(1, _header(10 + i, 65536), memoryview(xs[i]), time.monotonic() + 10)
    for w in waiters:
        w.join(30)
    assert done == [True, True]
    assert all(np.array_equal(o, x) for o, x in zip(outs, xs, strict=True))


def test_a_wait_that_nothing_answers_ends_at_its_deadline(pair):
    a, _ = pair
    req = a.irecv(1, _header(99, 16), memoryview(np.zeros(16, np.uint8)))
    t0 = time.monotonic()
    assert a.wait(req, t0 + 0.5) is False
    assert 0.45 <= time.monotonic() - t0 < 3.0 and not req.done()
