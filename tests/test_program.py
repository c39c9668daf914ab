"""Compiling a checked plan into the executor's program: copies into ``work`` that are only there to be sent
are left out where this executor makes them unnecessary, and kept where they are not."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import pytest

from erdma_core.algorithms import recursive_doubling, ring
from erdma_core.algorithms.schedule import Copy, Spec, Step, Xfer
from erdma_core.engine import executor
from erdma_core.engine.executor import Op
from erdma_core.engine.plans import Plan, plan
from erdma_core.engine.program import compile_plan
from erdma_core.protocol.reduce_ops import ReduceOp
from erdma_core.testing import World
from erdma_core.transport.request import Request


def _doubling(size: int, rank: int, count: int = 8) -> Plan:
    steps = tuple(recursive_doubling.allreduce(Spec("allreduce", rank, size, count)))
    return Plan(steps, (False,) * len(steps), True)


@pytest.mark.parametrize("size", [2, 4, 3])
def test_recursive_doubling_sends_from_out_without_copies(size):
    for rank in range(size):
        kept = compile_plan(_doubling(size, rank), range(size), 1 << 20, 4)
        elided = compile_plan(_doubling(size, rank), range(size), 1 << 20, 4, elide=True)
        assert not elided.uses_work and all(not st.copies for st in elided.stages)
        assert [[(m.buf, m.offset, m.count) for m in st.sends] for st in elided.stages] == \
               [[("out" if m.buf == "work" else m.buf, m.offset, m.count) for m in st.sends] for st in kept.stages]
        assert [st.recvs for st in elided.stages] == [st.recvs for st in kept.stages]
        if rank < 2:  # the exchanging ranks copy without elision
            assert kept.uses_work and any(st.copies for st in kept.stages)


def test_copies_stay_when_the_message_is_cut_into_chunks():
    """Between the chunks of one send the executor reduces what has landed: the copy is needed."""
    program = compile_plan(_doubling(2, 0, count=8), range(2), 4, 4, elide=True)
    assert program.uses_work and program.stages[0].copies and len(program.stages[0].sends) == 2


@pytest.mark.parametrize("target, early, elided", [
    (("out", 4, 4), False, True),   # lands beside what is sent
    (("out", 2, 4), False, False),  # lands in what is sent, while it may still be on its way out
])
def test_copies_stay_when_a_receive_lands_in_what_is_sent(target, early, elided):
    buf, off, cnt = target
    steps = (Step(copies=(Copy("out", 0, "work", 0, 4),), sends=(Xfer(1, "work", 0, 4),),
                  recvs=(Xfer(1, buf, off, cnt),)),)
    program = compile_plan(Plan(steps, (early,), True), range(2), 1 << 20, 4, elide=True)
    assert (not program.stages[0].copies) is elided
    assert program.uses_work is not elided


def test_nothing_is_left_out_when_a_step_sends_what_another_copied():
    steps = (Step(copies=(Copy("out", 0, "work", 0, 4),), sends=(Xfer(1, "work", 0, 4),)),
             Step(copies=(Copy("out", 4, "work", 4, 4),), sends=(Xfer(1, "work", 0, 4),)))
    program = compile_plan(Plan(steps, (False, False), True), range(2), 1 << 20, 4, elide=True)
    assert [len(st.copies) for st in program.stages] == [1, 1] and program.uses_work


def test_copies_stay_when_the_next_steps_early_receive_lands_in_what_is_sent():
    steps = (Step(copies=(Copy("out", 0, "work", 0, 4),), sends=(Xfer(1, "work", 0, 4),)),
             Step(recvs=(Xfer(1, "out", 0, 4),)))
    assert compile_plan(Plan(steps, (False, True), True), range(2), 1 << 20, 4, elide=True).stages[0].copies
    assert not compile_plan(Plan(steps, (False, False), True), range(2), 1 << 20, 4, elide=True).stages[0].copies


def _allreduce_sizes(pg):
    """Float32 values whose sums are exact (small integers), so any order gives the numpy reference's bits."""
    out = []
    for n in (1, 1000, 16384, 100_003):
        base = np.arange(n, dtype=np.float32) % 1024
        a = base * (pg.rank() + 1)
        pg.allreduce(a, algorithm="recursive_doubling")
        out.append(a.tobytes() == (base * (pg.size() * (pg.size() + 1) // 2)).tobytes())
    return out, [c.work for c in pg.runner._plans.values()]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_recursive_doubling_allreduce_without_the_work_buffer(size):
    with World(size) as w:
        for results, works in w.run(_allreduce_sizes):
            assert all(results) and works == [None] * len(works)


def _scratch_addresses(pg):
    a = np.ones(16384, np.float32)
    pg.allreduce(a)  # recursive doubling: its receive lands in scratch memory
    views = [pg.runner.scratch(16384, np.dtype(np.float32), slot) for slot in (0, 1, 2)]
    return [v.ctypes.data % 4096 for v in views], bool((a == pg.size()).all())


def test_scratch_memory_starts_on_a_page():
    """Receives land in it; a copy into memory 1-31 bytes past its source modulo 4 KiB is many times slower
    on some AMD cores, and malloc places arrays exactly so after whole-page ones."""
    with World(2) as w:
        assert w.run(_scratch_addresses) == [([0, 0, 0], True)] * 2


class _Recording:
    """A transport that records the executor's calls: sends complete at once, receives only when waited
    for (then holding ones), so the order shows when each receive was posted relative to the sends and to
    the landing of the step before."""

    stripes = 1  # one send under way at a time

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def isend(self, peer, header, data, deadline):
        self.calls.append(("send", header.tag))
        req = Request()
        req.complete()
        return req

    def irecv(self, peer, header, out):
        self.calls.append(("post", header.tag))
        out[:] = b"\x00" * len(out)
        return _Tagged(header.tag)

    def wait(self, req, deadline):
        self.calls.append(("land", req.tag))
        req.complete()
        return True

    def abort(self, error):
        raise AssertionError(f"aborted: {error}")


@attrs.frozen
class _Component:
    factory: Callable[[Spec], list[Step]]
    name: str
    plugin: str


class _Tagged(Request):
    __slots__ = ("tag",)

    def __init__(self, tag: int) -> None:
        super().__init__()
        self.tag = tag


def test_two_rank_ring_posts_the_allgather_receive_once_its_sends_are_done():
    """The second step receives into what the first sent from: it cannot be posted before the first step's
    sends, but it is posted as soon as they are done, before the first step's receive lands (the peer's
    second-step data then finds it posted instead of being buffered)."""
    steps = tuple(ring.allreduce(Spec("allreduce", 0, 2, 8)))
    p = plan(_Component(ring.allreduce, "ring", "test"), Spec("allreduce", 0, 2, 8))
    assert p.early == (False, False) and p.after_sends == (False, True)
    program = compile_plan(p, range(2), 2, 4)
    assert [st.after_sends for st in program.stages] == [False, True]
    transport = _Recording()
    op = Op(name="allreduce", opcode=1, dtype="float32", dtype_code=1, numel=8, job=1, group=0, seq=0,
            reduce_op=ReduceOp.SUM, timeout=10.0, ranks=range(2), rank=0)
    out = np.arange(8, dtype=np.float32)
    executor.run(program, {"in": out, "out": out, "work": np.empty(0, np.float32)}, transport, op)
    assert len(steps) == 2 and transport.calls == [
        ("post", 0), ("post", 1), ("send", 0), ("send", 1),  # step 1: 4 elements each way, in 2 chunks
        ("post", 2), ("post", 3),                            # step 2's receives, once step 1 has sent
        ("land", 0), ("land", 1), ("send", 2), ("send", 3), ("land", 2), ("land", 3)]
    # it reduced zeros into the half it keeps and received zeros into the other
    np.testing.assert_array_equal(out, [0, 0, 0, 0, 4, 5, 6, 7])


class _Whole(_Recording):
    """A transport with a path of its own (``Transport.run_program``) that takes programs as ``takes`` says."""

    def __init__(self, takes: bool) -> None:
        super().__init__()
        self.takes = takes
        self.offered: list[tuple[int, int]] = []

    def run_program(self, program, buffers, op):
        self.offered.append((len(program.stages), op.seq))
        if self.takes:
            buffers["out"][:] = 42  # what its own path produced
        return self.takes


@pytest.mark.parametrize("takes", [True, False])
def test_the_executor_leaves_a_program_to_a_transport_that_runs_it_whole(takes):
    p = plan(_Component(ring.allreduce, "ring", "test"), Spec("allreduce", 0, 2, 8))
    program = compile_plan(p, range(2), 2, 4)
    op = Op(name="allreduce", opcode=1, dtype="float32", dtype_code=1, numel=8, job=1, group=0, seq=7,
            reduce_op=ReduceOp.SUM, timeout=10.0, ranks=range(2), rank=0)
    transport, out = _Whole(takes), np.arange(8, dtype=np.float32)
    executor.run(program, {"in": out, "out": out, "work": np.empty(0, np.float32)}, transport, op)
    assert transport.offered == [(2, 7)]
    if takes:  # nothing went through the calls per message
        assert transport.calls == [] and (out == 42).all()
    else:
        assert len(transport.calls) == 12 and out.tolist() == [0, 0, 0, 0, 4, 5, 6, 7]
