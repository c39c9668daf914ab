"""The store every rank of a job shares: what discovery methods provide and set-up, transports and elastic
groups use."""

from __future__ import annotations

from typing import Protocol


class Store(Protocol):
    """What a discovery method gives every rank of a job: the same key-value store. ``set`` publishes,
    ``get`` waits up to ``timeout`` seconds for a key to appear (else ``CollectiveTimeoutError``), ``add``
    is an atomic counter (a method whose adds only end exact, as a DHT's per-writer shares, says so), ``close``
    releases what this rank holds. Values are any bytes; a method bounds their size (the TCP store at 16 MiB, a
    DHT record at about 7.8 KB) and refuses a larger one with an error. ``erdma_core.testing.
    store_conformance`` checks a method against these rules. Optional: ``compare_set(key, expected,
    desired)`` (atomic; returns the value after; an absent key compares as b""; elastic groups need it),
    ``host`` (the host ranks reach the store at; the TCP transport advertises the address that routes there)
    and ``cleanup()`` (called by rank 0 at the end of the job)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def close(self) -> None: ...
