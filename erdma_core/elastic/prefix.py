"""A view of a store under a key prefix, so that each epoch's ProcessGroup set-up has keys of its own."""

from __future__ import annotations

from typing import Any


class PrefixStore:
    """Keys of ``store`` under ``prefix``. ``close`` leaves the store open: the elastic group owns it."""

    def __init__(self, store: Any, prefix: str) -> None:
        self._store, self._prefix = store, prefix
        host = getattr(store, "host", None)
        if host is not None:
            self.host = host  # the TCP transport advertises the address that routes to the store's host

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self._prefix + key, value)

    def get(self, key: str, timeout: float) -> bytes:
        return self._store.get(self._prefix + key, timeout)  # type: ignore[no-any-return]

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._prefix + key, amount)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._store.compare_set(self._prefix + key, expected, desired)  # type: ignore[no-any-return]

    def close(self) -> None:
        pass
