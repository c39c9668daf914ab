"""Linear (flat) gather and scatter: the root talks to every rank directly."""

from __future__ import annotations

from .schedule import Copy, Schedule, Spec, Step, Xfer


def gather(spec: Spec) -> Schedule:
    """``in``: ``count`` elements; at the root ``out`` gets every rank's input in rank order."""
    n, r = spec.count, spec.rank
    if r != spec.root:
        return [Step(sends=(Xfer(spec.root, "in", 0, n),))]
    return [Step(copies=(Copy("in", 0, "out", r * n, n),),
                 recvs=tuple(Xfer(q, "out", q * n, n) for q in range(spec.size) if q != r))]


def scatter(spec: Spec) -> Schedule:
    """At the root ``in`` holds ``size`` slices of ``count``; rank q gets slice q in ``out``."""
    n, r = spec.count, spec.rank
    if r != spec.root:
        return [Step(recvs=(Xfer(spec.root, "out", 0, n),))]
    return [Step(copies=(Copy("in", r * n, "out", 0, n),),
                 sends=tuple(Xfer(q, "in", q * n, n) for q in range(spec.size) if q != r))]


def barrier(spec: Spec) -> Schedule:
    """Dissemination barrier: ceil(log2 p) rounds of zero-byte messages to rank r + 2^k."""
    p, r = spec.size, spec.rank
    steps, k = [], 1
    while k < p:
        steps.append(Step(sends=(Xfer((r + k) % p, "out", 0, 0),), recvs=(Xfer((r - k) % p, "out", 0, 0),)))
        k <<= 1
    return steps
