"""A send or receive that a transport completes and a collective waits for."""

from __future__ import annotations

import threading
import time

from ..wire import Header

_SETTLE = threading.Lock()  # two threads that wait for one request make one event


class Request:
    """One send or receive. ``wait`` returns when done or raises what failed it. A receive whose message
    came encoded has ``encoded`` set: ``(header, payload)``, the payload to decode into the receive's memory.

    Most requests are completed by the thread that waits for them (it drives the sockets) or before anyone
    waits, so the event a blocked thread sleeps on is made only when a thread does block. ``finished`` is
    ``done()`` as an attribute (read it, never write it), for the engine's per-message loops."""

    __slots__ = ("_event", "encoded", "error", "finished", "via")

    def __init__(self) -> None:
        self.finished = False
        self.via = 0  # which of a paired transport's two made it (``paired``: its ``wait`` goes there)
        self._event: threading.Event | None = None
        self.error: BaseException | None = None
        self.encoded: tuple[Header, memoryview] | None = None

    def complete(self, error: BaseException | None = None) -> None:
        # No lock: under the GIL, ``finished`` is written before ``_event`` is read here, and a waiter writes
        # ``_event`` before it reads ``finished`` (``settled``), so one of the two always sees the other.
        if self.finished:
            return
        self.error = error
        self.finished = True
        event = self._event
        if event is not None:
            event.set()

    def done(self) -> bool:
        return self.finished

    def settled(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the request to finish, well or not; True if it did."""
        if self.finished:
            return True
        with _SETTLE:  # two waiters make one event
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if self.finished:  # completed before the event was there to be set
            return True
        return event.wait(timeout)

    def wait(self, deadline: float) -> bool:
        """Wait until ``deadline`` (time.monotonic()); False on timeout, raise the request's error."""
        if not self.settled(max(0.0, deadline - time.monotonic())):
            return False
        if self.error is not None:
            raise self.error
        return True
