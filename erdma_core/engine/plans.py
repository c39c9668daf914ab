"""From an algorithm and a ``Spec`` to a checked plan: the schedule, which steps may post their receives
early, and whether it needs the ``work`` buffer. Built once per (algorithm, spec) and cached.

A schedule the executor could run wrongly is refused with a ``PluginError`` naming the algorithm and the
plugin that registered it: a buffer that does not exist or a range outside it, a write into ``in``, a peer
outside the group or the rank itself, and within a step a send overlapping a receive's target or two
receives overlapping (unless both reduce, which the executor applies in the order listed).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import attrs

from ..algorithms.schedule import Copy, Spec, Step, Xfer
from ..errors import PluginError
from ..protocol.ops import buffer_sizes

BUFFERS = ("in", "out", "work")


@attrs.frozen
class Plan:
    steps: tuple[Step, ...]
    early: tuple[bool, ...]  # step i's receives may be posted while step i-1 runs
    uses_work: bool
    after_sends: tuple[bool, ...] = ()  # else, once step i-1's sends are done (before its receives land)


@functools.lru_cache(maxsize=1024)
def plan(component: Any, spec: Spec) -> Plan:
    """The checked plan of ``component`` (a registered algorithm) for ``spec``."""
    try:
        schedule = component.factory(spec)
    except PluginError:
        raise
    except Exception as exc:
        raise PluginError(f"{_who(component)} failed to build a schedule for {_spec_text(spec)}: "
                          f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(schedule, list | tuple) or not all(isinstance(s, Step) for s in schedule):
        raise PluginError(f"{_who(component)} returned {type(schedule).__name__} for {_spec_text(spec)}; "
                          "expected a list of erdma_core.algorithms.schedule.Step")
    steps = tuple(schedule)
    problem = check(steps, spec)
    if problem:
        raise PluginError(f"{_who(component)} gave an invalid schedule for {_spec_text(spec)}: {problem}")
    return Plan(steps, lookahead(steps), any(touches_work(s) for s in steps), lookahead(steps, sends_done=True))


def touches_work(step: Any) -> bool:
    """Whether ``step`` (a schedule's Step, or a compiled Stage: both have copies, sends and recvs) reads or
    writes the ``work`` buffer."""
    return any(x.buf == "work" for x in (*step.sends, *step.recvs)) or \
        any("work" in (c.src, c.dst) for c in step.copies)


def _who(component: Any) -> str:
    return f"algorithm {component.name!r} from plugin {component.plugin!r}"


def _spec_text(spec: Spec) -> str:
    return f"{spec.op} on rank {spec.rank} of {spec.size} (count {spec.count})"


def _span(buf: str, lo: int, n: int) -> str:
    return f"{buf}[{lo}:{lo + n}]"


def check(steps: Sequence[Step], spec: Spec) -> str | None:
    """What is wrong with ``steps`` for ``spec``, or None."""
    sizes = buffer_sizes(spec)
    for i, step in enumerate(steps):
        for what, xs in (("sends", step.sends), ("receives", step.recvs)):
            for x in xs:
                if not isinstance(x, Xfer):
                    return f"step {i} {what} {x!r}, not an Xfer"
                if not 0 <= x.peer < spec.size or x.peer == spec.rank:
                    return f"step {i} {what} {_span(x.buf, x.offset, x.count)} with rank {x.peer}, which is " + (
                        "this rank" if x.peer == spec.rank else f"not a rank of the group (size {spec.size})")
                bad = _range(x.buf, x.offset, x.count, sizes)
                if bad:
                    return f"step {i} {what} {bad}"
        for c in step.copies:
            if not isinstance(c, Copy):
                return f"step {i} copies {c!r}, not a Copy"
            bad = _range(c.src, c.src_offset, c.count, sizes) or _range(c.dst, c.dst_offset, c.count, sizes)
            if bad:
                return f"step {i} copies {bad}"
            if c.dst == "in":
                return f"step {i} copies into {_span('in', c.dst_offset, c.count)}: 'in' is the caller's input, read-only"
        for x in step.recvs:
            if x.buf == "in":
                return f"step {i} receives into {_span('in', x.offset, x.count)}: 'in' is the caller's input, read-only"
        clash = _clash(step)
        if clash:
            return f"step {i} {clash}"
    return None


def _range(buf: str, lo: int, n: int, sizes: dict[str, int]) -> str | None:
    if buf not in sizes:
        return f"buffer {buf!r}, which does not exist (buffers: {', '.join(BUFFERS)})"
    if lo < 0 or n < 0 or lo + n > sizes[buf]:
        return f"{_span(buf, lo, n)}, outside {buf!r} ({sizes[buf]} elements)"
    return None


def _overlap(a: Xfer, b: Xfer) -> bool:
    return a.buf == b.buf and a.offset < b.offset + b.count and b.offset < a.offset + a.count


def _clash(step: Step) -> str | None:
    for s in step.sends:
        for r in step.recvs:
            if _overlap(s, r) and s.count and r.count:
                how = "reduces a receive from" if r.reduce else "receives from"
                return (f"sends {_span(s.buf, s.offset, s.count)} to rank {s.peer} and {how} rank {r.peer} into "
                        f"{_span(r.buf, r.offset, r.count)}: a step's receives may land while its sends still read, "
                        f"so the sent elements could already hold received data. Send from a copy: add "
                        f"Copy({s.buf!r}, {s.offset}, 'work', {s.offset}, {s.count}) to the step's copies "
                        f"and send 'work'")
    for a, b in itertools.combinations(step.recvs, 2):
        if _overlap(a, b) and a.count and b.count and not (a.reduce and b.reduce):
            return (f"receives {_span(a.buf, a.offset, a.count)} from rank {a.peer} and "
                    f"{_span(b.buf, b.offset, b.count)} from rank {b.peer}: overlapping receives land in any order "
                    "(only receives that both reduce may overlap; they are applied in the order listed)")
    return None


def lookahead(schedule: Sequence[Step], sends_done: bool = False) -> tuple[bool, ...]:
    """For each step: may its receives be posted while the step before it is still running? Yes when its
    in-place receives touch nothing the previous step reads or writes, nor what its own copies (made when it
    starts) read or write. Reducing receives land in scratch memory of their own, so they always may.
    ``sends_done``: the same once the previous step's sends are done (their memory is free again), so what
    they read does not count; a step that lands where the step before sent from (a two-rank ring's
    allgather) can then still post its receives before its peer's data comes, instead of buffering it."""

    def spans(xs: Sequence[Xfer]) -> list[tuple[str, int, int]]:
        return [(x.buf, x.offset, x.offset + x.count) for x in xs]

    def copied(step: Step) -> list[tuple[str, int, int]]:  # what a step's copies read and write
        return [(b, lo, lo + c.count) for c in step.copies for b, lo in ((c.src, c.src_offset), (c.dst, c.dst_offset))]

    out = [False] if schedule else []  # a group of one runs no steps
    for prev, step in itertools.pairwise(schedule):
        written = [(c.dst, c.dst_offset, c.dst_offset + c.count) for c in prev.copies]
        busy = ([] if sends_done else spans(prev.sends)) + spans(prev.recvs) + written + copied(step)
        mine = spans([x for x in step.recvs if not x.reduce])
        out.append(not any(b == m and lo < mhi and mlo < hi for b, lo, hi in busy for m, mlo, mhi in mine))
    return tuple(out)
