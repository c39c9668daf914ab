"""Schedules are pure: check them with no network, by running every rank's schedule in one process."""

from __future__ import annotations

import numpy as np
import pytest

from erdma_core.algorithms.schedule import Options, Spec
from erdma_core.plugins import builtin
from erdma_core.testing.schedules import simulate as run_simulation

ALGOS = {}
builtin.erdma_register_algorithms(lambda op, name, fn, **kw: ALGOS.__setitem__((op, name), fn))


def simulate(op, name, specs, buffers):
    run_simulation(ALGOS[(op, name)], specs, buffers)


@pytest.mark.parametrize("p", range(1, 10))
@pytest.mark.parametrize("name", ["ring", "halving_doubling", "recursive_doubling", "tree", "parameter_server"])
@pytest.mark.parametrize("n", [0, 1, 5, 64])
def test_allreduce_schedules(p, name, n):
    bufs = [{"out": np.arange(n, dtype=np.int64) * (r + 1)} for r in range(p)]
    for ps in (1, 2):
        simulate("allreduce", name, [Spec("allreduce", r, p, n, options=Options.of({"servers": ps})) for r in range(p)],
                 bufs := [{"out": np.arange(n, dtype=np.int64) * (r + 1)} for r in range(p)])
        for b in bufs:
            assert (b["out"] == np.arange(n) * p * (p + 1) // 2).all()


@pytest.mark.parametrize("p", range(1, 10))
@pytest.mark.parametrize("name", ["ring", "recursive_doubling"])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_allgather_schedules(p, name, n):
    bufs = [{"in": np.arange(n) + 100 * r, "out": np.full(n * p, -1)} for r in range(p)]
    simulate("allgather", name, [Spec("allgather", r, p, n) for r in range(p)], bufs)
    want = np.concatenate([np.arange(n) + 100 * q for q in range(p)])
    for b in bufs:
        assert (b["out"] == want).all(), (b["out"], want)


@pytest.mark.parametrize("p", range(1, 10))
@pytest.mark.parametrize("name", ["ring", "recursive_halving"])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_reduce_scatter_schedules(p, name, n):
    ins = [np.arange(n * p) * (r + 1) + r for r in range(p)]
    bufs = [{"in": ins[r], "out": np.full(n, -1)} for r in range(p)]
    simulate("reduce_scatter", name, [Spec("reduce_scatter", r, p, n) for r in range(p)], bufs)
    total = sum(ins)
    for r, b in enumerate(bufs):
        assert (b["out"] == total[r * n:(r + 1) * n]).all(), (r, b["out"])


def test_small_allgather_reduce_scatter_and_alltoall_take_the_fewest_steps():
    """auto: log2(p) exchanges while the whole buffer is at most tiny_message_bytes, the ring above; alltoall
    in one step (linear) while the local input is at most small_message_bytes, among 3 or more ranks."""
    from erdma_core import load_config

    conf = load_config({})
    choose = builtin.erdma_choose_algorithm
    assert choose(op="allgather", nbytes=16384, world_size=4, config=conf) == "recursive_doubling"
    assert choose(op="allgather", nbytes=16385, world_size=4, config=conf) == "ring"
    assert choose(op="reduce_scatter", nbytes=8192, world_size=8, config=conf) == "recursive_halving"
    assert choose(op="reduce_scatter", nbytes=8193, world_size=8, config=conf) == "ring"
    assert choose(op="broadcast", nbytes=(1 << 20) + 1, world_size=3, config=conf) == "scatter_allgather"
    assert choose(op="broadcast", nbytes=1 << 20, world_size=3, config=conf) == "tree"
    assert choose(op="broadcast", nbytes=64 << 20, world_size=2, config=conf) == "tree"
    assert choose(op="alltoall", nbytes=1 << 20, world_size=3, config=conf) == "linear"
    assert choose(op="alltoall", nbytes=(1 << 20) + 1, world_size=3, config=conf) == "pairwise"
    assert choose(op="alltoall", nbytes=4096, world_size=2, config=conf) == "pairwise"
    linear = ALGOS[("alltoall", "linear")](Spec("alltoall", 1, 4, 0, send_counts=(1,) * 4, recv_counts=(1,) * 4))
    assert len(linear) == 1 and [x.peer for x in linear[0].sends] == [2, 3, 0]  # one wait; rank r+1 first
    steps = ALGOS[("allgather", "recursive_doubling")](Spec("allgather", 0, 8, 4))
    assert sum(1 for s in steps if s.sends) == 3  # against the ring's 7


@pytest.mark.parametrize("p", range(1, 10))
def test_rooted_and_barrier_schedules(p):
    for root in range(p):
        bufs = [{"out": np.full(3, r)} for r in range(p)]
        simulate("broadcast", "tree", [Spec("broadcast", r, p, 3, root=root) for r in range(p)], bufs)
        assert all((b["out"] == root).all() for b in bufs)
        for n in (1, p - 1, 3 * p + 2):  # fewer elements than ranks leaves some slices empty
            bufs = [{"out": np.arange(n) + 1000 * r} for r in range(p)]
            simulate("broadcast", "scatter_allgather", [Spec("broadcast", r, p, n, root=root) for r in range(p)],
                     bufs)
            assert all((b["out"] == np.arange(n) + 1000 * root).all() for b in bufs), (p, root, n)
        bufs = [{"out": np.full(3, r + 1)} for r in range(p)]
        simulate("reduce", "tree", [Spec("reduce", r, p, 3, root=root) for r in range(p)], bufs)
        assert (bufs[root]["out"] == p * (p + 1) // 2).all()
    simulate("barrier", "dissemination", [Spec("barrier", r, p, 0) for r in range(p)],
             [{"out": np.empty(0)} for _ in range(p)])


@pytest.mark.parametrize("p", range(1, 8))
@pytest.mark.parametrize("name", ["pairwise", "linear", "sequential"])
def test_alltoall_schedules(p, name):
    send = [tuple((r + q) % 3 for q in range(p)) for r in range(p)]
    recv = [tuple(send[q][r] for q in range(p)) for r in range(p)]
    bufs = [{"in": np.concatenate([np.full(send[r][q], r * 10 + q) for q in range(p)]),
             "out": np.full(sum(recv[r]), -1)} for r in range(p)]
    simulate("alltoall", name, [Spec("alltoall", r, p, 0, send_counts=send[r], recv_counts=recv[r])
                                for r in range(p)], bufs)
    for r in range(p):
        assert (bufs[r]["out"] == np.concatenate([np.full(recv[r][q], q * 10 + r) for q in range(p)])).all()


def test_sequential_alltoall_is_one_pair_at_a_time():
    """In the sequential schedule each exchange waits for the token of the pair before it."""
    p = 4
    scheds = [ALGOS[("alltoall", "sequential")](Spec("alltoall", r, p, 0, send_counts=(1,) * p,
                                                         recv_counts=(1,) * p)) for r in range(p)]
    exchanges = [[s for s in sched if s.sends and s.recvs] for sched in scheds]
    assert [len(e) for e in exchanges] == [p - 1] * p
    # rank 3 takes part in pairs (0,3), (1,3), (2,3): before each it waits for a token
    tokens = [s for s in scheds[3] if s.recvs and not s.sends]
    assert len(tokens) == 3 and all(s.recvs[0].count == 0 for s in tokens)


def test_lookahead_posts_early_only_when_safe():
    from erdma_core.algorithms.schedule import Copy, Step, Xfer
    from erdma_core.engine.plans import lookahead

    send_a = Step(sends=(Xfer(1, "out", 0, 4),), recvs=(Xfer(1, "out", 4, 4),))
    recv_into_a = Step(recvs=(Xfer(1, "out", 2, 4),))        # overlaps what the step before sends
    recv_elsewhere = Step(recvs=(Xfer(1, "out", 8, 4),))
    reduce_into_a = Step(recvs=(Xfer(1, "out", 0, 4, reduce=True),))  # lands in scratch: safe
    with_copy = Step(copies=(Copy("in", 0, "out", 12, 1),), recvs=(Xfer(1, "out", 12, 1),))
    assert lookahead((send_a, recv_into_a)) == (False, False)
    assert lookahead((send_a, recv_elsewhere, reduce_into_a, with_copy)) == (False, True, True, False)
    copy_then_reduce = Step(copies=(Copy("out", 0, "work", 0, 4),), sends=(Xfer(1, "work", 0, 4),),
                            recvs=(Xfer(1, "out", 0, 4, reduce=True),))  # recursive doubling's step
    copy_reads_landing = Step(copies=(Copy("out", 8, "work", 0, 4),), recvs=(Xfer(1, "out", 8, 4),))
    assert lookahead((send_a, copy_then_reduce, copy_then_reduce)) == (False, True, True)
    assert lookahead((recv_elsewhere, copy_reads_landing)) == (False, False)
    # once the step before has sent everything, only its receives and copies are in the way
    send_only = Step(sends=(Xfer(1, "out", 0, 4),))
    assert lookahead((send_only, recv_into_a)) == (False, False)
    assert lookahead((send_only, recv_into_a), sends_done=True) == (False, True)
    assert lookahead((send_a, recv_into_a), sends_done=True) == (False, False)  # lands where send_a receives
    assert lookahead((recv_elsewhere, copy_reads_landing), sends_done=True) == (False, False)
    rd = tuple(ALGOS[("allreduce", "recursive_doubling")](Spec("allreduce", 0, 8, 100)))
    assert lookahead(rd) == (False, True, True)
    ring = tuple(ALGOS[("allreduce", "ring")](Spec("allreduce", 0, 4, 100)))
    assert lookahead(ring) == (False,) + (True,) * 5  # every ring step after the first can pre-post
