"""``Serial``, the queue a group's collectives run from, without a network: a stream of async calls runs back
to back on one runner, a waiting thread runs a queued call itself, and a completion callback that waits for
queued work never deadlocks, however it waits."""

from __future__ import annotations

import threading

import pytest

from erdma_core.api import serial as serial_mod
from erdma_core.api.serial import Serial
from erdma_core.api.work import Work


def where(log: list[str], value: int = 0):
    def fn() -> int:
        log.append(threading.current_thread().name)
        return value

    return fn


@pytest.fixture
def patient(monkeypatch):
    """A runner in callbacks keeps its claim for 5 s: what a standby runner does is then deterministic."""
    monkeypatch.setattr(serial_mod, "HANDOFF", 5.0)


def test_a_stream_of_async_calls_runs_back_to_back_on_one_runner(patient):
    s, log = Serial("t"), []
    gate = threading.Event()
    first = s.submit(lambda: gate.wait(10))  # holds the runner while the rest queue up
    futs = [s.submit(where(log, i)) for i in range(5)]
    gate.set()
    assert [f.result(10) for f in futs] == list(range(5)) and first.result(10)
    assert len(set(log)) == 1 and log[0].startswith("t-"), log  # no hand-off between them
    s.shutdown()


def test_a_waiting_thread_runs_a_queued_call_itself(patient):
    s, log = Serial("t"), []
    in_callback, release = threading.Event(), threading.Event()
    a = s.submit(lambda: None)
    a.add_done_callback(lambda _: (in_callback.set(), release.wait(10)))  # the runner lingers in a callback
    assert in_callback.wait(10)
    b = s.submit(where(log, 7))  # queued: the runner holds its claim, the standby runner waits 5 s for it
    Work(b, "b", 0, s.help).wait()  # (with a timeout it would wait instead: the call could outlast it)
    assert b.result() == 7 and log == [threading.current_thread().name]
    release.set()
    s.shutdown()


def test_a_callback_that_waits_for_queued_work_in_a_way_serial_cannot_see_still_ends():
    """The runner that completed ``first`` blocks in its callback on a future behind it (not through
    Work.wait, so it keeps its claim): a standby runner takes the queue after HANDOFF."""
    s, log = Serial("t"), []
    gate, issued, done = threading.Event(), threading.Event(), threading.Event()
    first = s.submit(lambda: gate.wait(10))
    later: list = []
    first.add_done_callback(lambda _: (issued.wait(10), later[0].result(10), done.set()))
    later.append(s.submit(where(log, 3)))
    issued.set()
    gate.set()
    assert done.wait(10), "a callback waiting for queued work deadlocked"
    assert later[0].result() == 3 and log and log[0] != threading.current_thread().name
    s.shutdown()


def test_a_callback_that_issues_a_call_gives_the_queue_up_at_once(patient):
    """With a 5 s claim, the callback's own call would wait 5 s if issuing it did not give the claim up."""
    s, log = Serial("t"), []
    gate, done = threading.Event(), threading.Event()
    results = []
    first = s.submit(lambda: gate.wait(10))
    queued = s.submit(where(log, 1))

    def hook(_):
        fut = s.submit(where(log, 2))
        results.append(fut.result(2))  # within 2 s: the queue went on without this thread
        results.append(s.call(where(log, 3)))  # a blocking call from the callback
        done.set()

    first.add_done_callback(hook)
    gate.set()
    assert done.wait(10) and results == [2, 3] and queued.result(1) == 1
    s.shutdown()


def test_wait_times_out_with_the_op_named():
    s = Serial("t")
    gate = threading.Event()
    w = Work(s.submit(lambda: gate.wait(10)), "allreduce", 3, s.help)
    from erdma_core.errors import CollectiveTimeoutError

    with pytest.raises(CollectiveTimeoutError, match=r"rank 3: Work.wait\(0.05\) for allreduce timed out"):
        w.wait(0.05)
    gate.set()
    assert w.wait(10)
    s.shutdown()


def test_a_callback_that_waits_for_queued_work_runs_it_and_keeps_the_queue_moving(patient):
    """A callback's ``Work.wait`` on a queued call runs it right there (nested in the callback); afterwards
    the queue is not left claimed: the next call runs at once, not after the 5 s claim."""
    s, log = Serial("t"), []
    gate, done = threading.Event(), threading.Event()
    first = s.submit(lambda: gate.wait(10))
    second = Work(s.submit(where(log, 2)), "b", 0, s.help)

    def hook(_):
        second.wait()
        done.set()

    first.add_done_callback(hook)
    gate.set()
    assert done.wait(10)
    third = s.submit(where(log, 3))
    assert third.result(2) == 3  # within 2 s: no claim left behind
    s.shutdown()
