"""A dead, slow or disagreeing peer gives every surviving rank a clear error, never a hang.

The worlds' collective timeout (60 s) is far above the World's answer limit (20 s): a survivor that only
noticed a dead peer by timing out would fail these tests with "no answer"."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from erdma_core import (
    AbortedError,
    AuthenticationError,
    CollectiveTimeoutError,
    ErdmaError,
    MismatchError,
    PeerLostError,
)

SLOW_TIMEOUT = {"timeouts.collective": 60.0}


def killed_mid_allreduce(pg):
    arr = np.ones(8 << 20, np.float32)  # 32 MiB: still on the wire when the rank dies
    if pg.rank() == pg.size() - 1:
        pg.allreduce(arr, async_op=True)
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(2):  # the first may still finish; the dead rank never joins the second
        pg.allreduce(arr)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_sigkill_mid_allreduce_raises_peer_lost_on_every_survivor(erdma_world, size):
    world = erdma_world(size, SLOW_TIMEOUT, timeout=20)
    outcomes = world.outcomes(killed_mid_allreduce)
    dead = size - 1
    assert "died" in outcomes[dead]
    for rank in range(dead):
        err = outcomes[rank]
        assert isinstance(err, PeerLostError), err
        assert err.peer == dead and err.op == "allreduce" and err.rank == rank
        assert f"rank {dead}" in str(err) and "allreduce" in str(err)


def numel_mismatch(pg):
    pg.allreduce(np.ones(12 if pg.rank() != 1 else 10, np.float32))


def dtype_mismatch(pg):
    pg.allreduce(np.ones(16, np.float32 if pg.rank() != 1 else np.int32))


def op_mismatch(pg):
    pg.allreduce(np.ones(16, np.float32), op="sum" if pg.rank() != 1 else "max")


def collective_mismatch(pg):
    arr = np.ones(16, np.float32)
    pg.allreduce(arr) if pg.rank() != 1 else pg.broadcast(arr, 0)


@pytest.mark.parametrize("case,needle", [(numel_mismatch, "numel="), (dtype_mismatch, "dtype="),
                                         (op_mismatch, "op="), (collective_mismatch, "broadcast(")])
def test_mismatch_is_detected_on_every_rank(erdma_world, case, needle):
    world = erdma_world(3, SLOW_TIMEOUT, timeout=20)
    outcomes = world.outcomes(case)
    for rank, err in enumerate(outcomes):
        assert isinstance(err, MismatchError), (rank, err)
        assert "mismatch between ranks" in str(err) and needle in str(err), str(err)
    # the group is aborted afterwards: later calls fail at once with the first cause
    later = world.outcomes(numel_mismatch)
    assert all(isinstance(e, MismatchError | AbortedError) for e in later)


def roots_disagree(pg, op):
    """Ranks name different roots (even ranks 0, odd ranks 1), then go on to an allreduce."""
    root = pg.rank() % 2
    a = np.full(8, pg.rank(), np.float32)
    if op == "broadcast":
        pg.broadcast(a, src=root)
    elif op == "reduce":
        pg.reduce(a, dst=root)
    elif op == "gather":
        pg.gather(a, [np.zeros(8, np.float32) for _ in range(pg.size())] if pg.rank() == root else None, dst=root)
    else:
        pg.scatter(a, [np.ones(8, np.float32)] * pg.size() if pg.rank() == root else None, src=root)
    pg.allreduce(np.ones(4, np.float32))
    return a


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("op", ["broadcast", "scatter"])
def test_roots_that_disagree_fail_every_rank(erdma_world, size, op):
    """Before: broadcast with src 0 on some ranks and 1 on others returned different results, exit 0."""
    outcomes = erdma_world(size, SLOW_TIMEOUT, timeout=20).outcomes(roots_disagree, op)
    for rank, err in enumerate(outcomes):
        assert isinstance(err, MismatchError), (rank, err)
        assert "root=" in str(err) or "aborted the job" in str(err), str(err)
    assert any(("root=0" in str(e) and "root=1" in str(e)) or "that this rank never received" in str(e)
               for e in outcomes)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("op", ["reduce", "gather"])
def test_receiving_roots_that_disagree_fail_every_rank(erdma_world, size, op):
    """Two ranks that each think they are reduce's root both wait, and no message exists that could tell
    them: they fail at the collective timeout (as with MPI or NCCL, where they hang), never with a result."""
    outcomes = erdma_world(size, {"timeouts.collective": 3.0}, timeout=20).outcomes(roots_disagree, op)
    for rank, err in enumerate(outcomes):
        assert isinstance(err, MismatchError | CollectiveTimeoutError), (rank, err)


def fault_on_rank_0(pg):
    if pg.rank() == 0:
        from erdma_core.protocol import reduce_ops

        def broken(*args, **kwargs):
            raise ValueError("injected fault")

        reduce_ops.reduce_into = broken  # what a bug in a reduction would do
    pg.allreduce(np.ones(1024, np.float32))


def test_a_fault_on_one_rank_aborts_its_peers_at_once(erdma_world):
    """Before: the faulty rank raised, and its peers waited for it until their collective timeout."""
    outcomes = erdma_world(3, SLOW_TIMEOUT, timeout=20).outcomes(fault_on_rank_0)
    assert isinstance(outcomes[0], ValueError) and "injected fault" in str(outcomes[0])
    for err in outcomes[1:]:
        assert isinstance(err, AbortedError), err
        assert "rank 0: allreduce (group 0, seq 1) failed there: ValueError: injected fault" in str(err), str(err)


def use_after_destroy(pg):
    sub = pg.new_group()
    sub.allreduce(np.ones(4, np.float32))
    sub.destroy()
    errors = []
    for call in (lambda: sub.allreduce(np.ones(4, np.float32)), lambda: sub.barrier(),
                 lambda: sub.send(np.ones(4, np.float32), 1 - pg.rank())):
        try:
            call()
            errors.append(None)
        except ErdmaError as exc:
            errors.append(str(exc))
    arr = np.ones(4, np.float32)
    pg.allreduce(arr)  # the default group goes on
    return errors, arr.tolist()


def test_an_op_on_a_destroyed_group_raises_on_every_rank(erdma_world):
    """Before: an allreduce after destroy() went through on one rank and failed on others blaming a peer."""
    for rank, (errors, arr) in enumerate(erdma_world(2).run(use_after_destroy)):
        assert arr == [2.0] * 4
        for op, err in zip(("allreduce", "barrier", "send"), errors, strict=True):
            assert err is not None and err.startswith(f"rank {rank}: {op} on group ") and \
                "after this group was destroyed" in err, err


def abort_while_the_peer_waits(pg):
    """Rank 0 aborts the job's group while rank 1 waits in an allreduce rank 0 never joins."""
    before = threading.active_count()
    if pg.rank() == 0:
        time.sleep(0.5)  # rank 1 is waiting by now
        start = time.monotonic()
        pg.abort()
        took = time.monotonic() - start
        try:
            pg.allreduce(np.ones(4, np.float32))
            after = None
        except ErdmaError as exc:
            after = str(exc)
        return took, after, threading.active_count() - before
    start = time.monotonic()
    try:
        pg.allreduce(np.ones(4, np.float32))
        return None
    except ErdmaError as exc:
        return time.monotonic() - start, exc


def test_abort_fails_the_peers_op_at_once_and_releases_the_group(erdma_world):
    """``abort()`` (before: there was none; torch's abort left the group's threads and sockets behind) fails
    a peer's pending op within seconds, naming the rank, without waiting for the collective timeout."""
    (took, after, threads), (waited, err) = erdma_world(2, SLOW_TIMEOUT, timeout=30).run(abort_while_the_peer_waits)
    assert took < 5.0, took
    assert after == "rank 0: allreduce on group 0 after this group was aborted (abort()); make a new group to go on"
    assert threads <= 0, threads
    assert waited < 10.0, waited
    assert isinstance(err, (AbortedError, PeerLostError)) and err.op == "allreduce", err
    assert "rank 0 aborted the job: rank 0: group 0 was aborted by the caller" in str(err) or \
        "lost rank 0" in str(err), err


def abort_naming_rank_2(pg):
    """Rank 0 aborts saying rank 2 is gone (a bad rank first) while rank 1 waits in an allreduce; rank 2 calls
    it once rank 1 has its word. (Were rank 2 waiting too, it would see rank 0 close, abort the job itself and
    tell rank 1, and on a lossy link, where rank 0's word may need sending again, that word could come first.)"""
    told = Path(tempfile.gettempdir()) / f"erdma-told-{os.getppid()}"  # the ranks' parent: the test's world
    if pg.rank() == 0:
        time.sleep(0.5)  # rank 1 is waiting by now
        try:
            pg.abort(gone=[3])
            bad = None
        except ValueError as exc:
            bad = str(exc)
        pg.abort(gone=[2], why="its heartbeats stopped")
        return bad, pg.failure()
    if pg.rank() == 2:
        deadline = time.monotonic() + 20
        while not told.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        told.unlink(missing_ok=True)
    try:
        pg.allreduce(np.ones(4, np.float32))
        return None
    except ErdmaError as exc:
        return exc
    finally:
        if pg.rank() == 1:
            told.touch()


def test_an_abort_saying_a_rank_is_gone_names_it_and_sends_it_no_word(erdma_world):
    """``abort(gone=[r])``: still an abort (``AbortedError``, nothing counted out), naming rank ``r`` in
    ``gone`` on the aborting rank and in the word its peers get; the word does not go to ``r`` itself, which
    finds the connection to rank 0 gone when it calls the collective."""
    (bad, failure), told, cut = erdma_world(3, SLOW_TIMEOUT, timeout=30).run(abort_naming_rank_2)
    assert bad == "abort(gone=[3]): 3 is not a rank of group 0 (0..2)", bad
    assert type(failure) is AbortedError and failure.gone == (2,), failure
    assert str(failure) == "rank 0: group 0 was aborted by the caller: rank 2 is gone (its heartbeats stopped)"
    assert type(told) is AbortedError and told.gone == (2,) and told.op == "allreduce", told
    assert "rank 0 aborted the job: rank 0: group 0 was aborted by the caller: rank 2 is gone" in str(told), told
    assert isinstance(cut, PeerLostError) and cut.peer == 0 and cut.op == "allreduce", cut


def one_rank_late(pg):
    if pg.rank() == 1:
        time.sleep(3)
        return "late"
    pg.allreduce(np.ones(4, np.float32))


def frames_of_a_peers_death(pg):
    import traceback

    if pg.rank() == 1:
        os._exit(3)  # rank 1 dies; the others' next allreduce fails
    try:
        pg.allreduce(np.ones(1 << 16, np.float32))
    except PeerLostError as exc:
        files = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
        return type(exc).__name__, exc.__cause__, exc.__suppress_context__, files
    return None


def test_a_survivors_error_comes_without_the_librarys_frames_and_chains(erdma_world):
    """Before: each survivor of a failed rank printed ~80 lines: the error chained to its cause, each with
    eRDMA's internal frames (executor, transport, mailbox). The message names rank, op and cause already."""
    outcomes = erdma_world(3, SLOW_TIMEOUT, timeout=60).outcomes(frames_of_a_peers_death)
    for rank in (0, 2):
        name, cause, suppressed, files = outcomes[rank]
        assert (name, cause, suppressed) == ("PeerLostError", None, True), outcomes[rank]
        inside = [f for f in files if "/erdma_core/" in f and not f.endswith("process_group.py")]
        assert not inside, files


def one_rank_absent(pg, algorithm):
    """Rank 1 skips the allreduce that the others run; rank 2 enters it a little later than rank 0."""
    if pg.rank() == 1:
        time.sleep(6)
        return "absent"
    if pg.rank() == 2:
        time.sleep(0.3)
    pg.allreduce(np.ones(1 << 16, np.float32), algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
def test_a_timeout_names_the_rank_that_never_called_the_collective(erdma_world, algorithm):
    """Before: the first rank to time out blamed whichever neighbour it waited on (rank 0 waits on rank 2 in
    a ring of 3), and its ABORT carried that to every rank; nobody named rank 1, which never came."""
    world = erdma_world(3, {"timeouts.collective": 2.0}, timeout=30)
    outcomes = world.outcomes(one_rank_absent, algorithm)
    assert outcomes[1] == "absent"
    for rank in (0, 2):
        err = outcomes[rank]
        assert isinstance(err, CollectiveTimeoutError) and err.op == "allreduce", err
        assert "waiting for rank 1, which sent nothing of it: rank 1 has not called it" in str(err), err


def test_timeout_names_op_and_peer(erdma_world):
    world = erdma_world(2, {"timeouts.collective": 1.0}, timeout=20)
    outcomes = world.outcomes(one_rank_late)
    assert outcomes[1] == "late"
    err = outcomes[0]
    assert isinstance(err, CollectiveTimeoutError) and err.op == "allreduce"
    assert "hit its timeout of 1.0s waiting for rank 1" in str(err)


def _connect(rank, job, store, results, timeout):
    from erdma_core.plugins.builtin import TCP_OPTIONS
    from erdma_core.transport.base import TransportContext
    from erdma_core.transport.tcp import TcpTransport

    t = TcpTransport(None, {k: o.default for k, o in TCP_OPTIONS.items()})
    try:
        t.connect(TransportContext(rank=rank, world_size=2, store=store, job=job, connect_timeout=timeout))
        results[rank] = "connected"
    except Exception as exc:
        results[rank] = exc
    finally:
        t.close()


def test_handshake_rejects_another_job(tmp_path):
    from erdma_core.discovery import FileStore

    store, results = FileStore(tmp_path), {}
    threads = [threading.Thread(target=_connect, args=(r, job, store, results, 2.0)) for r, job in
               ((0, 0x1111), (1, 0x2222))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert isinstance(results[1], AuthenticationError)
    assert "rank 0 refused the connection: it belongs to another job" in str(results[1])
    assert isinstance(results[0], CollectiveTimeoutError) and "ranks [1] did not connect" in str(results[0])
    assert "claimed rank 1: it belongs to another job" in str(results[0])


def test_handshake_same_job_connects(tmp_path):
    from erdma_core.discovery import FileStore

    store, results = FileStore(tmp_path), {}
    threads = [threading.Thread(target=_connect, args=(r, 0x77, store, results, 10.0)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {0: "connected", 1: "connected"}


def bad_inputs(pg):
    errors = []
    checks = [
        lambda: pg.allreduce(np.ones(3, np.bool_), op="avg"),
        lambda: pg.allreduce(np.ones(3, np.complex64)),
        lambda: pg.allreduce(np.ones(3, np.float32), op="median"),
        lambda: pg.allreduce(np.frombuffer(b"\0" * 12, np.float32)),
        lambda: pg.broadcast(np.ones(3), src=5),
        lambda: pg.allgather(np.zeros(5, np.float32), np.ones(3, np.float32)),
        lambda: pg.allgather(np.zeros(3, np.int64), np.ones(3, np.float32)),
        lambda: pg.alltoall(np.zeros(4), np.zeros(4), input_split_sizes=[1, 2]),
        lambda: pg.allreduce("not a tensor"),
        lambda: pg.allreduce(np.ones(3, np.float32), algorithm="rnig"),
        lambda: pg.reduce_scatter(np.ones(1, np.float16), np.ones(1, np.float16), op="bxor"),
    ]
    for check in checks:
        try:
            check()
            errors.append(None)
        except Exception as exc:
            errors.append((type(exc).__name__, str(exc)))
    return errors


def test_bad_input_errors_name_the_problem(erdma_world):
    errs = erdma_world(1).run(bad_inputs)[0]
    assert errs[0] == ("TypeError", "ReduceOp.AVG needs a numeric dtype, got bool")
    assert errs[1][0] == "TypeError" and "unsupported dtype 'complex64'" in errs[1][1] and "bfloat16" in errs[1][1]
    assert errs[2] == ("ValueError", "unknown reduce op 'median'; valid choices: SUM, PROD, MIN, MAX, AVG, BAND, BOR, "
                                   "BXOR")
    assert errs[3][0] == "ValueError" and "read-only" in errs[3][1]
    assert errs[4] == ("ValueError", "src=5 is not a rank of this group (size 1)")
    assert errs[5][0] == "ValueError" and "output has 5 elements; world size 1 x input 3 = 3" in errs[5][1]
    assert errs[6] == ("TypeError", "output: dtype int64 does not match the input's float32")
    assert errs[7][0] == "ValueError" and "input_split_sizes=[1, 2] must be 1" in errs[7][1]
    assert errs[8][0] == "TypeError" and "got str" in errs[8][1]
    assert errs[9][0] == "PluginError" and "Unknown allreduce algorithm 'rnig'" in errs[9][1] \
        and "did you mean 'ring'" in errs[9][1]
    assert errs[10] == ("TypeError", "ReduceOp.BXOR needs an integer or bool dtype (int8, int16, int32, int64, uint8, "
                                     "bool), got float16")


def test_a_set_up_that_fails_after_connecting_gives_back_its_transport_and_tells_the_peers(tmp_path, monkeypatch):
    """Rank 1's transport connected, then a later set-up step failed on it: its connections and threads are
    given back as it raises (not kept open by the traceback), and rank 0's first collective fails at once,
    naming rank 1, instead of waiting out timeouts.collective."""
    from erdma_core.api import join
    from erdma_core.discovery import FileStore

    real = join._check_unique

    def flaky(store, job, rank):
        if rank == 1:
            raise ErdmaError("rank 1: a set-up step after connecting failed (injected)")
        real(store, job, rank)

    monkeypatch.setattr(join, "_check_unique", flaky)
    # on TCP over a Unix socket, whose set-up ends with an exchange both ranks make (the single-copy probe):
    # rank 1 cannot fail before rank 0's set-up is past its look for a rank that gave up, whatever the load
    conf = join.load_config(None, **{"timeouts.collective": 60.0, "timeouts.connect": 20.0, "transport.name": "tcp",
                                     "transport.tcp.local_sockets": True})
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            pg = join.init_with_store(FileStore(tmp_path), r, 2, conf)
        except ErdmaError as exc:
            results[r] = exc
            return
        try:
            pg.allreduce(np.ones(4, np.float32))
            results[r] = "completed"
        except ErdmaError as exc:
            results[r] = exc
        finally:
            pg.destroy()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert str(results[1]) == "rank 1: a set-up step after connecting failed (injected)"
    error = results.get(0, "rank 0 had no outcome within 60 s")  # nor timeouts.collective: the peer said why
    assert isinstance(error, (PeerLostError, AbortedError)) and "rank 1" in str(error), error
    assert not [t.name for t in threading.enumerate() if t.name.endswith("-1") and t.name.startswith("erdma-")]
