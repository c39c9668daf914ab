"""Recursive doubling allreduce, the latency-optimal one: log2(p) steps, each a full exchange of the buffer
with the rank whose number differs in one bit, both sides adding the same two values (so every rank ends
with the same bits). Each step sends a copy in ``work``: its receive is reduced into ``out`` while the send
may still be reading. A world that is not a power of two first folds: rank p2 + i hands its buffer to rank
i, which returns the result at the end.
"""

from __future__ import annotations

from .schedule import Copy, Schedule, Spec, Step, Xfer


def allreduce(spec: Spec) -> Schedule:
    p, r, n = spec.size, spec.rank, spec.count
    p2 = 1 << (p.bit_length() - 1)
    extra = p - p2
    if r >= p2:
        return [Step(sends=(Xfer(r - p2, "out", 0, n),)), Step(recvs=(Xfer(r - p2, "out", 0, n),))]
    steps: Schedule = []
    if r < extra:
        steps.append(Step(recvs=(Xfer(r + p2, "out", 0, n, reduce=True),)))
    mask = 1
    while mask < p2:
        partner = r ^ mask
        steps.append(Step(copies=(Copy("out", 0, "work", 0, n),), sends=(Xfer(partner, "work", 0, n),),
                          recvs=(Xfer(partner, "out", 0, n, reduce=True),)))
        mask <<= 1
    if r < extra:
        steps.append(Step(sends=(Xfer(r + p2, "out", 0, n),)))
    return steps
