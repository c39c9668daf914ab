"""The compiled path (``transport.verbs.native``, ``steps.c``) on SoftRoCE: collectives without reductions run
whole in C, byte-exact against numpy; a collective of another size or kind on one rank, a rank that dies mid
all-to-all and one that never calls reach every rank as MismatchError, PeerLostError and a timeout."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from erdma_core.sdk import CollectiveTimeoutError, MismatchError, PeerLostError

SMALL_SLOTS = {"transport.verbs.slots": 4, "transport.verbs.slot_bytes": 16384,
               "transport.verbs.zero_copy_bytes": 0}


def _piece(sender: int, receiver: int, count: int, salt: int) -> np.ndarray:
    """What ``sender`` sends ``receiver``: ``count`` int32s that name both and their place."""
    return np.arange(count, dtype=np.int32) * 7 + sender * 1000 + receiver * 100 + salt


def _count(sender: int, receiver: int, salt: int) -> int:
    return (sender + 1) * 3000 + receiver * 11 + salt  # uneven: pieces over and under a slot


def _exchanges(pg: Any) -> list[str]:
    r, n = pg.rank(), pg.size()
    bad = []
    for salt, algorithm in enumerate(("sequential", "pairwise", "sequential")):
        sends = [_count(r, q, salt) for q in range(n)]
        recvs = [_count(q, r, salt) for q in range(n)]
        out = np.zeros(sum(recvs), np.int32)
        pg.alltoall(out, np.concatenate([_piece(r, q, c, salt) for q, c in enumerate(sends)]), recvs, sends,
                    algorithm=algorithm)
        if not np.array_equal(out, np.concatenate([_piece(q, r, c, salt) for q, c in enumerate(recvs)])):
            bad.append(f"alltoall {algorithm} salt {salt}")
    gathered = np.zeros(n * 50_000, np.float64)
    pg.allgather(gathered, np.full(50_000, r + 0.5))
    if not np.array_equal(gathered, np.repeat(np.arange(n) + 0.5, 50_000)):
        bad.append("allgather")
    b = np.arange(70_000, dtype=np.int64) if r == 1 else np.zeros(70_000, np.int64)
    pg.broadcast(b, src=1)
    if not np.array_equal(b, np.arange(70_000)):
        bad.append("broadcast")
    return bad


def _runs(pg: Any) -> tuple[list[str], int]:
    before = pg.transport.native_runs
    bad = _exchanges(pg)
    s = np.ones(1000, np.float32)
    pg.allreduce(s)  # a reduction: the executor's
    if not (s == pg.size()).all():
        bad.append("allreduce")
    return bad, pg.transport.native_runs - before


@pytest.mark.parametrize("config", [{}, SMALL_SLOTS], ids=["defaults", "small-slots"])
def test_collectives_without_reductions_run_whole_and_exact(erdma_world: Any, config: dict[str, Any]) -> None:
    results = erdma_world(3, {"transport.name": "verbs", **config}).run(_runs)
    assert results == [([], 5)] * 3


def test_without_native_the_executor_runs_them(erdma_world: Any) -> None:
    results = erdma_world(3, {"transport.name": "verbs", "transport.verbs.native": False}).run(_runs)
    assert results == [([], 0)] * 3


def _other_size(pg: Any) -> None:
    n = 4096 + (1000 if pg.rank() == 2 else 0)
    pg.alltoall(np.zeros(3 * n, np.int32), np.zeros(3 * n, np.int32))


def _other_kind(pg: Any) -> None:
    if pg.rank() == 2:
        pg.allreduce(np.ones(3 * 4096, np.int32))
    else:
        pg.alltoall(np.zeros(3 * 4096, np.int32), np.zeros(3 * 4096, np.int32))


@pytest.mark.parametrize("fn", [_other_size, _other_kind], ids=["size", "kind"])
def test_a_rank_calling_something_else_fails_every_rank_with_a_mismatch(erdma_world: Any, fn: Any) -> None:
    outcomes = erdma_world(3, {"transport.name": "verbs", "timeouts.collective": 60.0}, timeout=40).outcomes(fn)
    assert all(isinstance(e, MismatchError) for e in outcomes), outcomes


def _die(pg: Any) -> None:
    n = 1 << 18
    inp, out = np.ones(3 * n, np.int32), np.zeros(3 * n, np.int32)
    pg.alltoall(out, inp)
    if pg.rank() == 0:
        pg.alltoall(out, inp, async_op=True)
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(2):
        pg.alltoall(out, inp)


def test_a_rank_dying_mid_alltoall_reaches_every_survivor(erdma_world: Any) -> None:
    outcomes = erdma_world(3, {"transport.name": "verbs", "timeouts.collective": 60.0}, timeout=40).outcomes(_die)
    assert "died" in outcomes[0]
    assert all(isinstance(e, PeerLostError) and e.peer == 0 for e in outcomes[1:]), outcomes


def _absent(pg: Any) -> None:
    if pg.rank() == 2:
        time.sleep(8)
        return
    pg.alltoall(np.zeros(3 * 1000, np.int32), np.zeros(3 * 1000, np.int32))


def test_a_rank_that_never_calls_times_the_others_out_naming_it(erdma_world: Any) -> None:
    outcomes = erdma_world(3, {"transport.name": "verbs", "timeouts.collective": 3.0}, timeout=40).outcomes(_absent)
    assert all(isinstance(e, CollectiveTimeoutError) for e in outcomes[:2]), outcomes
    assert any("rank 2" in str(e) for e in outcomes[:2]), outcomes  # the one waiting on it names it
