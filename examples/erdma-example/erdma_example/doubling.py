"""Recursive doubling allreduce: in log2(p) steps every rank exchanges its whole buffer with the rank whose
number differs in one bit, and both add. Each step sends a copy in ``work``, because its receive is reduced
into ``out`` while the send may still be reading (the core refuses a step that sends and reduces the same
elements). A world that is not a power of two first folds: rank p2 + i hands its data to rank i and gets the
result back at the end. Partners add the same two values, so every rank ends with the same bits."""

from __future__ import annotations

from erdma_core.algorithms.schedule import Copy, Spec, Step, Xfer


def allreduce(spec: Spec) -> list[Step]:
    p, r, n = spec.size, spec.rank, spec.count
    p2 = 1 << (p.bit_length() - 1)  # the largest power of two <= p
    extra = p - p2
    if r >= p2:  # folded: hand over, then receive the result
        return [Step(sends=(Xfer(r - p2, "out", 0, n),)), Step(recvs=(Xfer(r - p2, "out", 0, n),))]
    steps = []
    if r < extra:
        steps.append(Step(recvs=(Xfer(r + p2, "out", 0, n, reduce=True),)))
    d = 1
    while d < p2:
        peer = r ^ d
        steps.append(Step(copies=(Copy("out", 0, "work", 0, n),), sends=(Xfer(peer, "work", 0, n),),
                          recvs=(Xfer(peer, "out", 0, n, reduce=True),)))
        d <<= 1
    if r < extra:
        steps.append(Step(sends=(Xfer(r + p2, "out", 0, n),)))
    return steps
