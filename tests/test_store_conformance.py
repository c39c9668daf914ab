"""The store conformance kit (``erdma_core.testing.store_conformance``) on the core's discovery methods:
``file://``, ``tcp://`` (rank 0 serves) and ``etcd://`` (a real 3-member cluster, where etcd is installed)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from erdma_core.testing import etcd
from erdma_core.testing.store_conformance import StoreConformance


class TestFileStore(StoreConformance):
    def url(self, tmp_path: Path) -> str:
        return f"file://{tmp_path}/store"


class TestTcpStore(StoreConformance):
    def url(self, tmp_path: Path) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if etcd.missing() is not None:
        pytest.skip(str(etcd.missing()))
    with etcd.EtcdCluster(3, tmp_path_factory.mktemp("etcd")) as c:
        yield c


class TestEtcdStore(StoreConformance):
    @pytest.fixture(autouse=True)
    def _cluster(self, cluster: Any) -> None:
        self.cluster = cluster

    def url(self, tmp_path: Path) -> str:
        return self.cluster.url(f"conformance-{tmp_path.name}")


class _Memory:
    """One dict shared by every rank's handle; each flaw breaks one rule."""

    def __init__(self, data: dict[str, bytes], lock: Any, flaw: str) -> None:
        self.data, self.lock, self.flaw = data, lock, flaw

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            if not (self.flaw == "first-wins" and key in self.data):
                self.data[key] = value

    def get(self, key: str, timeout: float) -> bytes:
        import time

        from erdma_core.errors import CollectiveTimeoutError

        deadline = time.monotonic() + timeout
        while key not in self.data:
            if time.monotonic() > deadline:
                if self.flaw == "none-for-absent":
                    return b""
                raise CollectiveTimeoutError(f"no {key}")
            time.sleep(0.01)
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        import time

        if self.flaw == "racy-add":
            value = int(self.data.get(key, b"0")) + amount
            time.sleep(0.0005)
            self.data[key] = str(value).encode()
            return value
        with self.lock:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            return value

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("flaw", "test"), [
    ("first-wins", "test_the_last_set_of_a_key_wins"),
    ("none-for-absent", "test_a_key_nobody_sets_times_out_with_collective_timeout_error"),
    ("racy-add", "test_counters_are_exact_under_racing_ranks_and_threads"),
])
def test_the_kit_finds_a_store_that_breaks_a_rule(flaw: str, test: str, tmp_path: Path) -> None:
    import contextlib
    import threading

    def kit(flaw: str) -> StoreConformance:
        class Kit(StoreConformance):
            wait_s = 1.0

            @contextlib.contextmanager
            def stores(self, tmp_path: Path) -> Any:
                data: dict[str, bytes] = {}
                lock = threading.Lock()
                yield [_Memory(data, lock, flaw) for _ in range(self.world)]

        return Kit()

    getattr(kit(""), test)(tmp_path)  # the faultless one passes
    with pytest.raises(AssertionError):
        getattr(kit(flaw), test)(tmp_path)
