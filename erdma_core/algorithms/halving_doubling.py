"""Recursive halving (reduce-scatter) then recursive doubling (allgather): log2(p) steps each way.

A world that is not a power of two first folds: of the first 2*rem ranks, each even rank hands its whole
buffer to the odd rank above it and sits out, and gets the result back at the end (Rabenseifner).
"""

from __future__ import annotations

from .schedule import Schedule, Spec, Step, Xfer


def allreduce(spec: Spec) -> Schedule:
    rank, p, n = spec.rank, spec.size, spec.count
    p2 = 1 << (p.bit_length() - 1)
    rem = p - p2
    whole = (0, n)
    if rank < 2 * rem and rank % 2 == 0:  # folded away
        return [Step(sends=(Xfer(rank + 1, "out", *whole),)), Step(recvs=(Xfer(rank + 1, "out", *whole),))]
    steps: Schedule = []
    if rank < 2 * rem:
        steps.append(Step(recvs=(Xfer(rank - 1, "out", *whole, reduce=True),)))
    vrank = rank // 2 if rank < 2 * rem else rank - rem

    def real(v: int) -> int:
        return 2 * v + 1 if v < rem else v + rem

    lo, hi = 0, n
    history = []
    d = p2 // 2
    while d >= 1:
        partner = vrank ^ d
        mid = lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if vrank < partner else ((mid, hi), (lo, mid))
        steps.append(Step(sends=(Xfer(real(partner), "out", give[0], give[1] - give[0]),),
                          recvs=(Xfer(real(partner), "out", keep[0], keep[1] - keep[0], reduce=True),)))
        history.append((partner, keep, give))
        lo, hi = keep
        d //= 2
    for partner, keep, give in reversed(history):
        steps.append(Step(sends=(Xfer(real(partner), "out", keep[0], keep[1] - keep[0]),),
                          recvs=(Xfer(real(partner), "out", give[0], give[1] - give[0]),)))
    if rank < 2 * rem:
        steps.append(Step(sends=(Xfer(rank - 1, "out", *whole),)))
    return steps
