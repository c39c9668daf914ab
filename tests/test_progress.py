"""Who runs a collective: a blocking call on the caller's own thread; async calls on the group's runner
threads, one at a time in issue order; a completion callback may issue collectives and wait for them,
even behind others queued before (DDP's communication hooks, e.g. PowerSGD, do exactly this). ``make test``
runs this file over QUIC too, whose waiting threads drive its connections as TCP's drive their sockets."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest


def who_runs(pg):
    import time

    seen = []
    a = np.ones(10)
    pg.allreduce(a)
    caller = threading.current_thread().name

    import erdma_core.engine.executor as mod

    orig = mod.run

    def spy(*args, **kw):
        seen.append(threading.current_thread().name)
        return orig(*args, **kw)

    mod.run = spy
    try:
        pg.allreduce(a)  # blocking: this thread
        works = [pg.allreduce(np.ones(10) * i, async_op=True) for i in range(3)]  # nobody waits: the runners
        deadline = time.monotonic() + 30
        while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
            time.sleep(0.001)
        progressed = [w.is_completed() for w in works]
        waited = [pg.allreduce(np.ones(10) * i, async_op=True) for i in range(3)]
        for w in waited:
            w.wait(30)  # a queued one is run by this thread, one already started by its runner
        pg.allreduce(a)
    finally:
        mod.run = orig
    return caller, seen, progressed


def test_blocking_calls_run_on_the_caller_and_async_ones_on_the_worker(erdma_shared_world):
    """Async calls progress on the group's runners with nobody waiting; a thread that waits for one that has
    not started runs it itself (no thread hand-off); blocking calls run on the caller."""
    for caller, seen, progressed in erdma_shared_world(2, {"timeouts.collective": 30.0}).run(who_runs):
        assert progressed == [True] * 3
        assert len(seen) == 8 and seen[0] == caller and seen[-1] == caller
        assert all(name.startswith("erdma-pg0") for name in seen[1:4]), seen
        assert all(name == caller or name.startswith("erdma-pg0") for name in seen[4:7]), seen


def collective_in_a_callback(pg):
    a, b, c = np.ones(1000), np.ones(1000) * 2, np.ones(1000) * 3
    done = threading.Event()
    errors = []

    def hook(_fut):
        try:
            pg.allreduce(b)  # blocking, on the worker thread that completed the first one
            pg.allreduce(c, async_op=True).wait(30)  # and an async one waited for right there
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        done.set()

    pg.allreduce(a, async_op=True).get_future().add_done_callback(hook)
    assert done.wait(30), "a collective issued from a completion callback deadlocked"
    pg.barrier()
    return errors, a[0], b[0], c[0]


def test_a_collective_issued_from_a_completion_callback_does_not_deadlock(erdma_world):
    """Before: the callback ran on the group's single worker thread and waited for that same thread."""
    for errors, a, b, c in erdma_world(3, {"timeouts.collective": 30.0}).run(collective_in_a_callback):
        assert errors == [] and (a, b, c) == (3.0, 6.0, 9.0)


def callback_behind_a_queued_collective(pg):
    a, b, c = np.ones(1 << 20), np.ones(10) * 2, np.ones(10) * 3
    done = threading.Event()
    errors = []

    def hook(_fut):
        try:
            pg.allreduce(c, async_op=True).wait()  # no timeout of its own: it must still end
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        done.set()

    first = pg.allreduce(a, async_op=True)
    first.get_future().add_done_callback(hook)
    second = pg.allreduce(b, async_op=True)  # queued behind the first, ahead of the callback's
    assert done.wait(30), "a callback waiting for a collective queued behind another deadlocked"
    second.wait(30)
    return errors, a[0], b[0], c[0]


def test_a_callback_waits_for_a_collective_queued_behind_another(erdma_world):
    """Before: the thread that finished the first collective ran its callback while the second waited for
    that same thread, and the callback's collective waited for the second."""
    for errors, a, b, c in erdma_world(3, {"timeouts.collective": 30.0}).run(callback_behind_a_queued_collective):
        assert errors == [] and (a, b, c) == (3.0, 6.0, 9.0)


def spin_of(pg):
    return pg.transport._progress.spin


@pytest.mark.skipif(os.environ.get("ERDMA_TRANSPORT", "tcp") != "tcp", reason="a TCP option (this file also runs over QUIC)")
def test_spin_us_reaches_the_socket_driver(erdma_shared_world):
    """``transport.tcp.spin_us`` is what the driver spins for (test_progress_driver shows what spinning does)."""
    assert erdma_shared_world(2, {"transport.tcp.spin_us": 750}).run(spin_of) == [750 / 1e6] * 2
