"""``Serial``: runs one group's collectives one at a time, in the order they were issued.

A blocking call with nothing queued or running runs on the caller's own thread: no hand-off to another
thread, which on a busy host costs more than a small collective itself. An ``async_op=True`` call, or a
blocking one issued while others are queued or running, waits in the queue and runs on one of the group's
runner threads after everything issued before it.

Completion callbacks are user code that may issue a collective and wait for it, or wait for one issued
earlier (DDP's communication hooks, e.g. PowerSGD, do). So a runner never runs callbacks while the queue
depends on it: it finishes the collective, hands the queue to another runner (waking an idle one, or
starting one) whenever something waits in it, and only then completes the future. The rule kept at all
times: while the queue is not empty and no collective runs, some thread outside user code is on its way
to run the queue's head. So a callback's wait ends as the collectives it waits for do, each bounded by the
group's timeout. Runners persist once started (usually two: one running, one in callbacks).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

_Item = tuple[Callable[[], Any], "cf.Future[Any]"]


class Serial:
    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Item] = deque()
        self._busy = False  # a collective of this group is running, on whichever thread
        self._idle = 0  # runners waiting for work (or started and about to)
        self._runners: list[threading.Thread] = []
        self._closed = False

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` after everything issued before it and return its result (a blocking call)."""
        with self._cond:
            inline = not self._busy and not self._queue
            if inline:
                self._busy = True
            else:
                fut = self._enqueue(fn)
        if not inline:
            return fut.result()  # everything ahead of it ends within its own timeout
        try:
            return fn()
        finally:
            with self._cond:
                self._busy = False
                self._wake()

    def submit(self, fn: Callable[[], Any]) -> cf.Future[Any]:
        """Queue ``fn`` after everything issued before it (an async call); its future is done when ``fn`` is."""
        with self._cond:
            return self._enqueue(fn)

    def _enqueue(self, fn: Callable[[], Any]) -> cf.Future[Any]:
        if self._closed:
            raise RuntimeError(f"{self._name}: the group was destroyed; no collective can be issued on it")
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
        runner = threading.Thread(target=self._run, name=f"{self._name}-{len(self._runners)}", daemon=True)
        self._runners.append(runner)
        self._idle += 1
        runner.start()

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._busy or not self._queue:
                    if self._closed and not self._queue:
                        self._idle -= 1
                        return
                    self._cond.wait()
                fn, fut = self._queue.popleft()
                self._busy = True
                self._idle -= 1
                self._cond.release()
                try:
                    outcome = _outcome(fn, fut)
                finally:
                    self._cond.acquire()
                    self._busy = False
                    self._wake()  # the queue goes on without this thread while it runs the callbacks
                self._cond.release()
                try:
                    _settle(fut, outcome)
                finally:
                    self._cond.acquire()
                    self._idle += 1

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
