"""A paired job's QUIC side, checked at once with the first transport (``ctx.taken``): QUIC connects to every
peer while the other transport checks its own, then lets go of the pairs the other one took, without a word on
either end, and carries the rest."""

from __future__ import annotations

import threading
import time

import numpy as np
from helpers import MemoryStore, options, start, wait_for

from erdma_core.sdk import ConfigError, Header
from erdma_core.toolkit import DATA

JOB = 91


def _header(seq: int, n: int) -> Header:
    return Header(kind=DATA, job=JOB, dtype=9, opcode=1, seq=seq, numel=n, count=n, nbytes=n)


def _links(t) -> set[int]:
    return t.endpoint.run_sync(lambda: set(t.mesh.links))


def _sessions_with(t, peer: int) -> int:
    return t.endpoint.run_sync(lambda: sum(s.rank == peer for s in t.mesh._sessions))


def test_the_pairs_another_transport_took_are_let_go_of_on_both_ends_and_the_rest_carry_data():
    """Three ranks; the other transport took the pair (0, 1). Before it says so, every pair has joined over
    QUIC (checked at once) and no rank's set-up has returned. Then ranks 0 and 1 let go of each other: no link,
    no connection, and past the idle timeout neither calls the other lost; the pairs with rank 2 carry data."""
    store = MemoryStore()
    said = threading.Event()
    took = {0: frozenset({1}), 1: frozenset({0}), 2: frozenset()}
    opts = options(secret="taken", idle_timeout=1.0, keepalive_interval=0.25)
    ranks = [start(r, 3, store, JOB, opts, timeout=30, peers=frozenset({0, 1, 2} - {r}),
                   taken=lambda r=r: took[r] if said.is_set() else None) for r in range(3)]
    ts = [t for t, _, _ in ranks]
    assert wait_for(lambda: all(t.endpoint is not None and _links(t) == {0, 1, 2} - {r} for r, t in enumerate(ts)),
                    30), [_links(t) if t.endpoint else None for t in ts]
    assert all(th.is_alive() for _, th, _ in ranks)  # none is done before it knows what the other one took
    said.set()
    for _, th, errors in ranks:
        th.join(30)
        assert not th.is_alive() and not errors, errors
    try:
        assert [t.peers() for t in ts] == [[2], [2], [0, 1]]
        assert [_links(t) for t in ts] == [{2}, {2}, {0, 1}]
        assert (_sessions_with(ts[0], 1), _sessions_with(ts[1], 0)) == (0, 0)
        time.sleep(2.5)  # past the idle timeout of the connections let go of
        assert [t.failure() for t in ts] == [None] * 3
        rng = np.random.default_rng(3)
        for seq, (src, dst) in enumerate([(0, 2), (2, 1), (1, 2), (2, 0)]):
            x = rng.integers(0, 256, 100_000, dtype=np.uint8)
            out = np.zeros_like(x)
            r = ts[dst].irecv(src, _header(seq, x.size), memoryview(out))
            ts[src].isend(dst, _header(seq, x.size), memoryview(x), time.monotonic() + 20)
            assert ts[dst].wait(r, time.monotonic() + 20)
            assert np.array_equal(out, x)
    finally:
        for t in ts:
            t.close()


def test_a_set_up_beside_a_transport_that_failed_stops_with_its_reason():
    """The other transport's set-up failed (``taken`` raises): QUIC's stops with that error at its next look,
    not at its connect timeout, and gives its socket and threads back."""
    store = MemoryStore()
    why = "rank 1: set-up stopped: TCP: rank 0 refused the job's secret"

    def taken() -> frozenset[int] | None:
        raise ConfigError(why)

    t, th, errors = start(1, 2, store, JOB, options(secret="taken"), timeout=60, peers=frozenset({0}), taken=taken)
    th.join(30)
    assert not th.is_alive()
    assert [type(e) for e in errors] == [ConfigError] and str(errors[0]) == why, errors
    assert t.endpoint is not None and t.endpoint.sock.fileno() == -1  # closed
