"""Where a blocking collective's wall time goes, phase by phase, without a profiler's distortion.

cProfile charges every Python call, so code made of many small calls looks costlier than it is; this
timeline instead wraps the few seams between the engine's phases (the executor, its receive posting, the
transport's ``isend`` and ``wait``, the reduction) with clock reads and sums, per op, the wall time spent
in each. Each wrapper costs a clock read or two and a call (a few tenths of a microsecond), which the
"rest" rows absorb. Used by ``profile_small`` in the rank processes.
"""

from __future__ import annotations

import statistics
import time
import types
from collections.abc import Callable
from typing import Any

PHASES = (
    ("API, planning and issue order (before the executor)", "api"),
    ("posting receives (headers, mailbox)", "post"),
    ("sending (transport.isend: the socket write, or the queueing)", "send"),
    ("waiting for peers' data (driving the sockets, matching)", "wait"),
    ("reducing (numpy)", "reduce"),
    ("rest of the executor (steps, copies, landing)", "engine"),
    ("after the executor (finish, completion)", "after"),
)


class Timeline:
    """Installs the wrappers on ``transport`` and the engine's modules; ``call()`` runs one op and records
    its phases. ``restore()`` takes the wrappers off again."""

    def __init__(self, transport: Any) -> None:
        from erdma_core.engine import executor
        from erdma_core.protocol import reduce_ops

        self._ns = time.perf_counter_ns
        self._sums = dict.fromkeys(("post", "send", "wait", "reduce"), 0)
        self._marks: list[int] = []  # executor entry and exit
        self.ops: list[dict[str, int]] = []
        self._undo: list[Callable[[], None]] = []
        self._wrap(executor, "_post", "post")
        self._wrap(reduce_ops, "reduce_into", "reduce")
        self._wrap(transport, "isend", "send")
        self._wrap(transport, "wait", "wait")
        run = executor.run
        marks, ns = self._marks, self._ns

        def timed_run(*args: Any, **kwargs: Any) -> Any:
            marks.append(ns())
            try:
                return run(*args, **kwargs)
            finally:
                marks.append(ns())

        executor.run = timed_run
        self._undo.append(lambda: setattr(executor, "run", run))

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        inner, sums, ns = getattr(owner, name), self._sums, self._ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = ns()
            try:
                return inner(*args, **kwargs)
            finally:
                sums[phase] += ns() - t

        setattr(owner, name, timed)
        if isinstance(owner, types.ModuleType):
            self._undo.append(lambda: setattr(owner, name, inner))
        else:  # an instance: dropping its attribute brings back its class's method
            self._undo.append(lambda: delattr(owner, name))

    def call(self, op: Callable[[], object]) -> None:
        sums, marks = self._sums, self._marks
        for k in sums:
            sums[k] = 0
        marks.clear()
        t0 = self._ns()
        op()
        t1 = self._ns()
        if len(marks) < 2:  # nothing ran through the executor (a group of one)
            return
        inside = marks[-1] - marks[0]
        engine = inside - sums["post"] - sums["send"] - sums["wait"] - sums["reduce"]
        self.ops.append({"api": marks[0] - t0, "engine": engine, "after": t1 - marks[-1], **sums, "total": t1 - t0})

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()

    def report(self) -> str:
        if not self.ops:
            return "phases: no op ran through the executor"
        n = len(self.ops)
        mean_total = sum(o["total"] for o in self.ops) / n
        rows = []
        for label, key in PHASES:
            values = [o[key] for o in self.ops]
            mean = sum(values) / n
            rows.append(f"  {label:<60} {mean / 1e3:8.1f} us/op {mean / mean_total:6.1%}   "
                        f"(median {statistics.median(values) / 1e3:.1f})")
        head = (f"wall time per op by phase, {n} ops, no profiler (mean; median of the whole op "
                f"{statistics.median(o['total'] for o in self.ops) / 1e3:.1f} us, mean {mean_total / 1e3:.1f} us):")
        return "\n".join([head, *rows])
