"""The compiled path (``transport.verbs.native``, ``steps.c``) on SoftRoCE: collectives without reductions run
whole in C, byte-exact against numpy; reductions it computes run whole in C too, with the executor's results
byte for byte (integers also against numpy), over every allreduce algorithm, with slots smaller than the
messages; a collective of another size or kind on one rank, a rank that dies mid all-to-all and one that
never calls reach every rank as MismatchError, PeerLostError and a timeout."""

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
    pg.allreduce(s, op="min")  # a reduction the compiled path leaves to the executor
    if not (s == 1).all():
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
        pg.allreduce(np.ones(3 * 4096, np.float32), op="min")  # (the executor's: its frames reach the others)
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


REDUCTIONS = [("int32", "sum"), ("int64", "max"), ("uint8", "bxor"), ("int16", "prod"), ("int32", "avg"),
              ("float32", "sum"), ("float64", "prod"), ("float32", "avg")]
ALLREDUCE = ("ring", "halving_doubling", "recursive_doubling", "tree")


def _values(dtype: str, rank: int, n: int, salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    if dtype.startswith("float"):
        return rng.standard_normal(n).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)


def _reductions(pg: Any) -> tuple[list[bytes], list[str], int]:
    """Every pairing in REDUCTIONS through allreduce's algorithms, reduce_scatter and reduce (20,000 and more
    elements: more than the small slots' ring), then an allreduce of more than ``native_reduce_bytes`` (the
    message path's); the results' bytes, integer results that differ from numpy's reduction over the ranks'
    inputs, and how many collectives ran whole on the compiled path."""
    r, p = pg.rank(), pg.size()
    before = pg.transport.native_runs
    results, wrong = [], []
    for salt, (dtype, op) in enumerate(REDUCTIONS):
        n = 20_002 + 3 * salt
        ufunc = {"sum": np.add, "avg": np.add, "max": np.maximum, "bxor": np.bitwise_xor, "prod": np.multiply}[op]
        inputs = np.stack([_values(dtype, q, n, salt) for q in range(p)])
        want = ufunc.reduce(inputs, dtype=dtype) if op != "avg" else None  # (wrapping, as the ranks' own dtype)
        for algorithm in ALLREDUCE:
            a = _values(dtype, r, n, salt)
            pg.allreduce(a, op=op, algorithm=algorithm)
            results.append(a.tobytes())
            if want is not None and not dtype.startswith("float") and not np.array_equal(a, want):
                wrong.append(f"allreduce {dtype} {op} {algorithm}")
        out = np.zeros(1000, dtype)
        pg.reduce_scatter(out, _values(dtype, r, 1000 * p, salt), op=op)
        results.append(out.tobytes())
        a = _values(dtype, r, n, salt)
        pg.reduce(a, dst=1, op=op)
        results.append(a.tobytes() if r == 1 else b"")
    nat = pg.transport.native
    big = np.ones((nat.reduce_bytes if nat is not None else 1 << 20) // 4 + 1, np.float32)
    pg.allreduce(big)
    if not (big == p).all():
        wrong.append("allreduce of more than a ring")
    return results, wrong, pg.transport.native_runs - before


def test_reductions_run_whole_with_the_executors_results(erdma_world: Any) -> None:
    """The compiled path (with the default slots, and with slots smaller than the messages: sends wait for
    credits while the step's reducing receives go on) gives the executor's results byte for byte; integers
    match numpy's reduction of the inputs."""
    verbs = {"transport.name": "verbs", "timeouts.collective": 120.0}
    small_slots = {**verbs, **SMALL_SLOTS, "transport.verbs.native_reduce_bytes": 1 << 20}
    native = erdma_world(3, verbs, timeout=300).run(_reductions)
    small = erdma_world(3, small_slots, timeout=300).run(_reductions)
    executor = erdma_world(3, {**verbs, "transport.verbs.native": False}, timeout=300).run(_reductions)
    runs = len(REDUCTIONS) * (len(ALLREDUCE) + 2)
    assert [(w, n) for _, w, n in native] == [([], runs)] * 3
    assert [(w, n) for _, w, n in small] == [([], runs)] * 3
    assert [(w, n) for _, w, n in executor] == [([], 0)] * 3
    for rank in range(3):
        assert native[rank][0] == executor[rank][0], rank
        assert small[rank][0] == executor[rank][0], rank
