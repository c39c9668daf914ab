"""A view of a store under a key prefix, so that each epoch's ProcessGroup set-up has keys of its own, and
a set-up that its caller can call off while it waits (a member lapsed, another member's set-up failed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import AbortedError, CollectiveTimeoutError

LOOK_S = 0.25  # seconds: how often a set-up that waits on the store asks whether it is called off


class PrefixStore:
    """Keys of ``store`` under ``prefix``. ``close`` leaves the store open: the elastic group owns it.

    ``called_off()``, while the set-up runs, says why it should stop (or None); it is asked at most every
    ``LOOK_S`` seconds, by every operation and between slices of a long ``get``, and a reason raises
    ``AbortedError`` there. Every transport looks at the store while it waits for its peers
    (``transport.base.failed_elsewhere``), so the whole set-up ends within about ``LOOK_S`` plus the
    transport's own look interval. ``settle()`` once the set-up is done: from then on nothing is called off
    (the group's ``abort`` ends a collective instead)."""

    def __init__(self, store: Any, prefix: str, called_off: Callable[[], str | None] | None = None) -> None:
        self._store, self._prefix = store, prefix
        self._called_off = called_off
        self._looked = 0.0
        self._why: str | None = None
        host = getattr(store, "host", None)
        if host is not None:
            self.host = host  # the TCP transport advertises the address that routes to the store's host

    def settle(self) -> None:
        self._called_off = None

    def _look(self) -> None:
        called_off = self._called_off
        if called_off is None:
            return
        now = time.monotonic()
        if self._why is None and now - self._looked >= LOOK_S:
            self._looked = now
            self._why = called_off()
        if self._why is not None:  # once called off, every later operation of the set-up ends too
            raise AbortedError(f"elastic: this epoch's set-up was called off: {self._why}")

    def set(self, key: str, value: bytes) -> None:
        self._look()
        self._store.set(self._prefix + key, value)

    def get(self, key: str, timeout: float) -> bytes:
        self._look()
        if self._called_off is None:
            return self._store.get(self._prefix + key, timeout)  # type: ignore[no-any-return]
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            try:
                return self._store.get(self._prefix + key, max(0.0, min(LOOK_S, left)))  # type: ignore[no-any-return]
            except CollectiveTimeoutError:
                if left <= LOOK_S:
                    raise
            self._look()

    def add(self, key: str, amount: int) -> int:
        self._look()
        return self._store.add(self._prefix + key, amount)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self._look()
        return self._store.compare_set(self._prefix + key, expected, desired)  # type: ignore[no-any-return]

    def close(self) -> None:
        pass
