"""``StoreConformance``: the behaviour every discovery method's store must show (``erdma_core.sdk.Store``),
with one store per rank of a job in this process. A discovery plugin's tests do

    from erdma_core.testing.store_conformance import StoreConformance

    class TestDht(StoreConformance):
        def url(self, tmp_path):
            return f"dht://127.0.0.1:{node_port}/conformance"

Each test opens the job's stores through the method's registered factory (rank 0 first: a method where rank
0 serves, as ``tcp://``, is up before the others dial), checks what one rank writes against what the others
read, and closes them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

from ..errors import CollectiveTimeoutError
from ..protocol.store import Store

SLACK_S = 5.0  # what a wait may overrun its timeout by on a busy machine


class StoreConformance:
    #: ranks of the job (stores opened in this process)
    world: ClassVar[int] = 3
    #: config keys the stores are opened with (the job's secret, the method's section)
    config: ClassVar[dict[str, Any]] = {"security.secret": "store-conformance"}
    #: what a get that waits may take beyond the set it waits for (a DHT's lookups take longer than a file's)
    wait_s: ClassVar[float] = 10.0
    #: the largest value the test sets (every method holds at least this much; the TCP store 16 MiB)
    large_value_bytes: ClassVar[int] = 60_000
    #: ``add`` returns a value no other add returned (an atomic counter, as set-up's rank draws need); a method
    #: whose counter only ends exact (a DHT's: each writer adds to its own share) says False, and is then
    #: checked with one writer per rank for a total with no add lost or doubled: a share that a racing write
    #: dropped must come back once its writer adds again (an ``add`` of 0 re-asserts it), so every rank reads
    #: the exact total after at most ``settle_rounds`` rounds of every rank adding 0
    atomic_add: ClassVar[bool] = True
    settle_rounds: ClassVar[int] = 3

    def url(self, tmp_path: Path) -> str:
        """The method's URL for a job of its own (``discovery.init_method``)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def stores(self, tmp_path: Path) -> Iterator[list[Store]]:
        from ..api.join import load_config
        from ..plugins.manager import components

        url = self.url(tmp_path)
        conf = load_config({**self.config, "discovery.init_method": url})
        factory = components().get("discovery", urlparse(url).scheme).factory
        opened: list[Store] = []
        try:
            for rank in range(self.world):
                opened.append(factory(url, rank, self.world, self.wait_s, conf))
            yield opened
        finally:
            for store in reversed(opened):  # rank 0, which may serve the others, last
                store.close()

    def test_what_one_rank_sets_every_other_reads_byte_for_byte(self, tmp_path: Path) -> None:
        values = {"empty": b"", "binary": bytes(range(256)) * 3, "large": os.urandom(self.large_value_bytes),
                  "text": b"a=b/c d"}
        with self.stores(tmp_path) as ranks:
            for i, (key, value) in enumerate(values.items()):
                ranks[i % len(ranks)].set(f"conf/{key}", value)
            for store in ranks:
                for key, value in values.items():
                    assert store.get(f"conf/{key}", self.wait_s) == value, key

    def test_the_last_set_of_a_key_wins(self, tmp_path: Path) -> None:
        with self.stores(tmp_path) as ranks:
            ranks[0].set("conf/over", b"first")
            ranks[-1].set("conf/over", b"second")
            deadline = time.monotonic() + self.wait_s
            while ranks[0].get("conf/over", self.wait_s) != b"second":
                assert time.monotonic() < deadline, "the later set never became what rank 0 reads"
                time.sleep(0.05)

    def test_a_get_waits_for_a_key_another_rank_sets_later(self, tmp_path: Path) -> None:
        with self.stores(tmp_path) as ranks:
            got: list[Any] = []
            waiter = threading.Thread(target=lambda: got.append(ranks[1].get("conf/later", 2 * self.wait_s)))
            start = time.monotonic()
            waiter.start()
            time.sleep(0.3)
            ranks[0].set("conf/later", b"now")
            waiter.join(2 * self.wait_s + SLACK_S)
            assert got == [b"now"] and time.monotonic() - start < self.wait_s + 0.3 + SLACK_S, got

    def test_a_key_nobody_sets_times_out_with_collective_timeout_error(self, tmp_path: Path) -> None:
        with self.stores(tmp_path) as ranks:
            start = time.monotonic()
            try:
                ranks[-1].get("conf/never", 0.5)
            except CollectiveTimeoutError:
                pass
            else:
                raise AssertionError("get of a key nobody set returned")
            assert time.monotonic() - start < 0.5 + SLACK_S

    def test_counters_are_exact_under_racing_ranks_and_threads(self, tmp_path: Path) -> None:
        threads_per_rank, adds = (4 if self.atomic_add else 1), 20
        with self.stores(tmp_path) as ranks:
            seen: list[int] = []
            lock = threading.Lock()

            def count(store: Store) -> None:
                mine = [int(store.add("conf/counter", 1)) for _ in range(adds)]
                with lock:
                    seen.extend(mine)

            workers = [threading.Thread(target=count, args=(s,)) for s in ranks for _ in range(threads_per_rank)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(60)
            total = len(ranks) * threads_per_rank * adds
            if self.atomic_add:
                assert sorted(seen) == list(range(1, total + 1)), "an add was lost, doubled or not atomic"
            assert len(seen) == total and max(seen) <= total
            if self.atomic_add:
                assert all(int(s.add("conf/counter", 0)) == total for s in ranks)
                return
            for _ in range(self.settle_rounds):
                for s in ranks:
                    s.add("conf/counter", 0)  # (puts back this rank's share if a racing write dropped it)
                reads = [int(s.add("conf/counter", 0)) for s in ranks]
                assert max(reads) <= total, f"a share was doubled: {reads}, {total} added"
                if reads == [total] * len(ranks):
                    break
            assert reads == [total] * len(ranks), f"{reads} after {self.settle_rounds} rounds, {total} added"

    def test_compare_set_lets_exactly_one_of_racing_ranks_win(self, tmp_path: Path) -> None:
        with self.stores(tmp_path) as ranks:
            if not all(callable(getattr(s, "compare_set", None)) for s in ranks):
                return  # optional: elastic groups need it, static jobs do not
            assert ranks[0].compare_set("conf/cas", b"x", b"never") != b"never"  # type: ignore[attr-defined]
            # (absent compares as b"", not b"x")
            after: list[bytes] = []
            lock = threading.Lock()

            def contend(store: Store, i: int) -> None:
                value = store.compare_set("conf/cas", b"", f"rank-thread {i}".encode())  # type: ignore[attr-defined]
                with lock:
                    after.append(value)

            workers = [threading.Thread(target=contend, args=(s, i)) for i, s in enumerate(ranks * 2)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(60)
            assert len(after) == len(workers) and len(set(after)) == 1, after  # every contender sees the winner
            assert all(s.get("conf/cas", self.wait_s) == after[0] for s in ranks)
