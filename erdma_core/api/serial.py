"""``Serial``: runs one group's collectives one at a time, in the order they were issued.

A blocking call with nothing ahead of it runs on the caller's own thread: no hand-off to another thread,
which on a busy host costs more than a small collective itself. An ``async_op=True`` call, or a blocking one
issued while others are still queued, runs on the group's worker thread after everything issued before it.
A call made on the worker thread itself (a completion callback that issues another collective and waits for
it, as DDP's communication hooks do) runs at once on that thread: queueing it behind the worker would wait
forever. ``_running`` is held while any collective of the group runs, on whichever thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any


class Serial:
    def __init__(self, name: str) -> None:
        self._lock = threading.Lock()
        self._running = threading.RLock()
        self._tail: cf.Future[Any] | None = None  # the last call queued on the worker
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._worker: int | None = None  # the worker thread's ident, once it has run something

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` after everything submitted before it and return its result (a blocking call)."""
        with self._lock:
            # nothing queued, and nothing running: or only what runs on this very thread (the worker, whose
            # completion callback issued this call; the lock is reentrant)
            inline = (self._tail is None or self._tail.done()) and self._running.acquire(blocking=False)
        if inline:
            try:
                return fn()
            finally:
                self._running.release()
        return self.submit(fn, on_worker_now=False).result()

    def submit(self, fn: Callable[[], Any], on_worker_now: bool = True) -> cf.Future[Any]:
        """Run ``fn`` after everything submitted before it, on the worker (an async call); its future is done
        when ``fn`` is. Issued from the worker thread itself, it runs at once there."""
        fut: cf.Future[Any] = cf.Future()
        with self._lock:
            prev, self._tail = self._tail, fut
            now = on_worker_now and threading.get_ident() == self._worker and (prev is None or prev.done())
            if not now:
                self._pool.submit(self._after, prev, fn, fut)
        if now:
            _execute(fn, fut)
        return fut

    def _after(self, prev: cf.Future[Any] | None, fn: Callable[[], Any], fut: cf.Future[Any]) -> None:
        self._worker = threading.get_ident()
        if prev is not None:
            cf.wait([prev])  # it may have failed; this one then fails on its own (the transport is aborted)
        with self._running:  # a blocking call may be running on its caller's thread
            _execute(fn, fut)

    def shutdown(self) -> None:
        """Finish what is queued and stop the worker."""
        self._pool.shutdown(wait=True)


def _execute(fn: Callable[[], Any], fut: cf.Future[Any]) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except BaseException as exc:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
