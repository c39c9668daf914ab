"""``Serial``: runs one group's collectives one at a time, in the order they were issued.

A blocking call with nothing queued or running runs on the caller's own thread: no hand-off to another
thread, which on a busy host costs more than a small collective itself. An ``async_op=True`` call, or a
blocking one issued while others are queued or running, waits in the queue and runs after everything issued
before it: on one of the group's runner threads, or on the thread that waits for it (``help``) when that
thread comes before a runner has started it (waking a runner and being woken by it cost more than the
collective when it is small).

Completion callbacks are user code that may issue a collective and wait for it, or wait for one issued
earlier (DDP's communication hooks, e.g. PowerSGD, do). A runner that finishes a collective completes its
future itself (callbacks run on it) and then takes the next queued collective: a stream of async calls
runs back to back on one thread. The queue must never depend on a thread stuck in user code, so while a
runner is in callbacks its claim on the queue is short: it gives it up at once when a callback issues a
collective or waits (``Work.wait``, ``blocking``), and an idle runner takes the queue anyway once the same
callback has run for ``HANDOFF`` seconds (it may be waiting some other way). So a callback's wait ends as
the collectives it waits for do, each bounded by the group's timeout. Runners persist once started (usually
two: one running, one standing by).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ErdmaError

_Item = tuple[Callable[[], Any], "cf.Future[Any]"]
HANDOFF = 0.002  # seconds a runner in completion callbacks keeps its claim on the queue before another takes it


class _Local(threading.local):
    settling: Serial | None = None  # the Serial this thread is a runner of, while it runs callbacks (a class
    # default: ``getattr(local, name, None)`` on a thread that never set it raises and catches AttributeError)


_local = _Local()


@contextmanager
def blocking() -> Iterator[None]:
    """Around a wait that may depend on queued collectives: on a runner in completion callbacks, the queue
    goes to another runner at once instead of after ``HANDOFF``."""
    serial: Serial | None = _local.settling
    if serial is not None:
        serial._give_up_claim()
    yield


class Serial:
    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # the blocking fast path takes the bare lock (cheaper)
        self._queue: deque[_Item] = deque()
        self._busy = False  # a collective of this group is running, on whichever thread
        self._idle = 0  # runners waiting for work (or started and about to)
        self._claims = 0  # runners in completion callbacks that will take the queue when they return
        self._epoch = 0  # counts completions, so that a runner standing by sees whether the same one lingers
        self._watching = 0  # runners standing by, in a timed wait for a claim to lapse
        self._runners: list[threading.Thread] = []
        self._closed = False

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` after everything issued before it and return its result (a blocking call)."""
        if _local.settling is self:
            self._give_up_claim()  # a callback issues a collective: the queue must not wait for this thread
        with self._lock:
            inline = not self._busy and not self._queue
            if inline:
                self._busy = True
            else:
                fut = self._enqueue(fn)
        if not inline:
            self.help(fut)  # run what is queued ahead, and this call, here while no runner is at it
            return fut.result()  # everything ahead of it ends within its own timeout
        try:
            return fn()
        finally:
            with self._lock:
                self._busy = False
                self._wake()

    def submit(self, fn: Callable[[], Any]) -> cf.Future[Any]:
        """Queue ``fn`` after everything issued before it (an async call); its future is done when ``fn`` is."""
        if _local.settling is self:
            self._give_up_claim()  # a callback issues a collective, and will likely wait for it
        with self._cond:
            return self._enqueue(fn)

    def _enqueue(self, fn: Callable[[], Any]) -> cf.Future[Any]:
        if self._closed:
            # (an ErdmaError: a thread that aborted the group meanwhile is a failure the caller handles as such)
            raise ErdmaError(f"{self._name}: the group was destroyed or aborted; no collective can be issued on it")
        fut: cf.Future[Any] = cf.Future()
        self._queue.append((fn, fut))
        self._wake()
        return fut

    def _wake(self) -> None:
        """(Holding the lock.) If the head of the queue can start, make sure a runner is on its way to it."""
        if self._busy or not self._queue:
            return
        if self._idle:
            self._cond.notify()
            return
        self._start_runner()

    def _start_runner(self) -> None:
        runner = threading.Thread(target=self._run, name=f"{self._name}-{len(self._runners)}", daemon=True)
        self._runners.append(runner)
        self._idle += 1
        runner.start()

    def _give_up_claim(self) -> None:
        """The calling runner, in completion callbacks, will not come back to the queue soon."""
        _local.settling = None
        with self._cond:
            self._claims -= 1
            self._cond.notify_all()

    def _next(self) -> _Item | None:
        """(Holding the lock.) The queued collective this runner takes next; None once closed and empty. A
        runner in callbacks holds a claim on the queue: another waits for it up to ``HANDOFF``."""
        while True:
            if self._closed and not self._queue:
                return None
            if self._busy or not self._queue:
                self._cond.wait()
                continue
            if not self._claims:
                return self._queue.popleft()
            epoch, deadline = self._epoch, time.monotonic() + HANDOFF
            while self._queue and not self._busy and self._claims and self._epoch == epoch:
                left = deadline - time.monotonic()
                if left <= 0:  # the same callbacks still run: they may wait for this queue
                    return self._queue.popleft()
                self._watching += 1
                self._cond.wait(left)
                self._watching -= 1

    def help(self, fut: cf.Future[Any]) -> None:
        """A thread about to wait for ``fut``: while ``fut`` is queued and no collective runs, run the queue's
        head on this thread (in issue order, up to ``fut``) rather than wait for a runner to be scheduled and
        then to wake this thread. Returns when ``fut`` is done or runs elsewhere."""
        with self._cond:
            while not self._busy and any(f is fut for _, f in self._queue):
                fn, head = self._queue.popleft()
                self._busy = True
                self._cond.release()
                try:
                    outcome = _outcome(fn, head)
                finally:
                    self._cond.acquire()
                    self._complete(head, outcome)
            if not self._busy and self._queue:
                self._cond.notify_all()  # the rest is the runners' again, at once

    def _run(self) -> None:
        with self._cond:
            while True:
                item = self._next()
                if item is None:
                    self._idle -= 1
                    return
                fn, fut = item
                self._busy = True
                self._idle -= 1
                self._cond.release()
                try:
                    outcome = _outcome(fn, fut)
                finally:
                    self._cond.acquire()
                    self._complete(fut, outcome)
                    self._idle += 1

    def _complete(self, fut: cf.Future[Any], outcome: tuple[bool, Any] | None) -> None:
        """(Called and returns with the lock held.) A collective ended on this thread: complete its future
        here (its callbacks run on this thread) while holding a claim on the queue, with another runner
        standing by in case the callbacks linger."""
        self._busy = False
        if self._queue:
            if not self._idle:
                self._start_runner()
            elif not self._watching:
                self._cond.notify()
        self._claims += 1
        self._epoch += 1
        self._cond.release()
        outer = _local.settling  # a callback that waited here ran this collective itself
        _local.settling = self
        try:
            _settle(fut, outcome)
        finally:
            claimed = _local.settling is self
            _local.settling = outer
            self._cond.acquire()
            if claimed:
                self._claims -= 1

    def shutdown(self) -> None:
        """Finish what is queued and stop the runners."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            runners = list(self._runners)
        for runner in runners:
            if runner is not threading.current_thread():  # destroyed from a completion callback
                runner.join()


def _outcome(fn: Callable[[], Any], fut: cf.Future[Any]) -> tuple[bool, Any] | None:
    """Run ``fn`` unless its future was cancelled: (True, result) or (False, exception)."""
    if not fut.set_running_or_notify_cancel():
        return None
    try:
        return True, fn()
    except BaseException as exc:
        return False, exc


def _settle(fut: cf.Future[Any], outcome: tuple[bool, Any] | None) -> None:
    """Complete ``fut``; its callbacks run here, on this thread."""
    if outcome is None:
        return
    ok, value = outcome
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)
