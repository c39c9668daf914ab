"""The latency-optimal schedules for small messages: log2(p) steps, each an exchange with the rank whose
number differs in one bit. A world that is not a power of two first folds: rank p2 + i (p2 the largest power
of two below p) hands its data to rank i, which returns the result at the end.

- allreduce (recursive doubling): every step exchanges the whole buffer, both sides adding the same two
  values (so every rank ends with the same bits). Each step sends a copy in ``work``: its receive is
  reduced into ``out`` while the send may still be reading.
- allgather (recursive doubling): step k exchanges the 2^k blocks gathered so far (with the folded ranks'
  blocks that ride along), so the data sent doubles each step.
- reduce_scatter (recursive halving): step k sends the half of what is still shared that the partner keeps
  and reduces the half this rank keeps, so the data sent halves each step.
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


def _riders(lo: int, hi: int, p2: int, p: int) -> tuple[int, int]:
    """The folded ranks whose blocks travel with blocks ``[lo, hi)`` of the power-of-two part: ``(first,
    how many)``."""
    return lo + p2, max(0, min(hi + p2, p) - (lo + p2))


def _blocks(peer: int, buf: str, lo: int, hi: int, p2: int, p: int, n: int, reduce: bool = False) -> tuple[Xfer, ...]:
    """Blocks ``[lo, hi)`` of ``buf`` and their riders, as transfers with ``peer``."""
    first, many = _riders(lo, hi, p2, p)
    xs = [Xfer(peer, buf, lo * n, (hi - lo) * n, reduce=reduce)]
    if many:
        xs.append(Xfer(peer, buf, first * n, many * n, reduce=reduce))
    return tuple(xs)


def allgather(spec: Spec) -> Schedule:
    """``in`` holds ``count`` elements; ``out`` ends with every rank's input in rank order."""
    p, r, n = spec.size, spec.rank, spec.count
    p2 = 1 << (p.bit_length() - 1)
    own = Step(copies=(Copy("in", 0, "out", r * n, n),))
    if r >= p2:
        return [own, Step(sends=(Xfer(r - p2, "out", r * n, n),)), Step(recvs=(Xfer(r - p2, "out", 0, p * n),))]
    steps: Schedule = [own]
    if r + p2 < p:
        steps.append(Step(recvs=(Xfer(r + p2, "out", (r + p2) * n, n),)))
    mask = 1
    while mask < p2:
        partner = r ^ mask
        mine, theirs = r & ~(mask - 1), partner & ~(mask - 1)
        steps.append(Step(sends=_blocks(partner, "out", mine, mine + mask, p2, p, n),
                          recvs=_blocks(partner, "out", theirs, theirs + mask, p2, p, n)))
        mask <<= 1
    if r + p2 < p:
        steps.append(Step(sends=(Xfer(r + p2, "out", 0, p * n),)))
    return steps


def reduce_scatter(spec: Spec) -> Schedule:
    """``in`` holds p blocks of ``count``; rank r ends with the reduction of block r in ``out``. The sums
    are made in ``work``."""
    p, r, n = spec.size, spec.rank, spec.count
    p2 = 1 << (p.bit_length() - 1)
    if r >= p2:
        return [Step(sends=(Xfer(r - p2, "in", 0, p * n),)), Step(recvs=(Xfer(r - p2, "out", 0, n),))]
    steps: Schedule = [Step(copies=(Copy("in", 0, "work", 0, p * n),))]
    if r + p2 < p:
        steps.append(Step(recvs=(Xfer(r + p2, "work", 0, p * n, reduce=True),)))
    lo, hi = 0, p2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if r < mid else ((mid, hi), (lo, mid))
        partner = r ^ ((hi - lo) // 2)
        steps.append(Step(sends=_blocks(partner, "work", *give, p2, p, n),
                          recvs=_blocks(partner, "work", *keep, p2, p, n, reduce=True)))
        lo, hi = keep
    last = Step(copies=(Copy("work", r * n, "out", 0, n),))
    if r + p2 < p:
        last = Step(copies=last.copies, sends=(Xfer(r + p2, "work", (r + p2) * n, n),))
    steps.append(last)
    return steps
