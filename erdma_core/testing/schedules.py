"""Check an algorithm's schedules with no network: every rank's schedule runs in this process, messages
move through per-pair queues, and the executor's rules (``erdma_core.engine.plans.check``) are applied.

    from erdma_core.testing.schedules import simulate
    specs = [Spec("allreduce", r, 4, 10) for r in range(4)]
    bufs = [{"out": np.arange(10) * (r + 1)} for r in range(4)]
    simulate(my_allreduce, specs, bufs)          # raises AssertionError on a bad schedule or a deadlock
    assert all((b["out"] == np.arange(10) * 10).all() for b in bufs)

Reductions are sums (``reduce=True`` adds). ``in``, ``out`` and ``work`` are created empty when a rank's
buffers do not name them (``work`` with ``spec.work_count`` elements of ``out``'s dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..algorithms.schedule import Spec, Step
from ..engine.plans import check


def simulate(schedule_fn: Callable[[Spec], list[Step]], specs: Sequence[Spec], buffers: Sequence[dict[str, Any]]) -> None:
    """Run ``schedule_fn``'s schedule for every spec (one per rank) on ``buffers`` (one dict per rank)."""
    scheds = []
    for spec, bufs in zip(specs, buffers, strict=True):
        sched = schedule_fn(spec)
        problem = check(sched, spec)
        assert problem is None, f"{spec.op} rank {spec.rank} of {spec.size}: {problem}"
        out = bufs.setdefault("out", np.empty(0))
        bufs.setdefault("in", np.empty(0, out.dtype))
        bufs.setdefault("work", np.zeros(spec.work_count, out.dtype))
        scheds.append(sched)
    queues: dict[tuple[int, int], list[np.ndarray]] = {}
    pos = [0] * len(specs)
    pending: list[list[Any] | None] = [None] * len(specs)
    progress = True
    while progress:
        progress = False
        for r, sched in enumerate(scheds):
            if pos[r] == len(sched):
                continue
            step = sched[pos[r]]
            b = buffers[r]
            if pending[r] is None:
                for c in step.copies:
                    b[c.dst][c.dst_offset:c.dst_offset + c.count] = b[c.src][c.src_offset:c.src_offset + c.count]
                for x in step.sends:
                    queues.setdefault((r, x.peer), []).append(b[x.buf][x.offset:x.offset + x.count].copy())
                pending[r] = list(step.recvs)
            waiting = pending[r]
            assert waiting is not None
            while waiting:
                x = waiting[0]
                q = queues.get((x.peer, r))
                if not q:
                    break
                data = q.pop(0)
                assert data.size == x.count, f"{specs[r].op}: rank {x.peer} sent {data.size} elements, rank {r} " \
                                             f"expected {x.count} ({x})"
                tgt = b[x.buf][x.offset:x.offset + x.count]
                tgt[...] = tgt + data if x.reduce else data
                waiting.pop(0)
            if not waiting:
                pending[r] = None
                pos[r] += 1
                progress = True
    assert pos == [len(s) for s in scheds], f"{specs[0].op} deadlocked at steps {pos} of {[len(s) for s in scheds]}"
    left = {k: len(v) for k, v in queues.items() if v}
    assert not left, f"messages sent but never received (from, to): {left}"
