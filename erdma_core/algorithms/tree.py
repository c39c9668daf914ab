"""Binomial trees rooted at any rank: reduce, broadcast, and allreduce as reduce-then-broadcast."""

from __future__ import annotations

from .schedule import Schedule, Spec, Step, Xfer


def reduce_steps(rank: int, p: int, root: int, buf: str, n: int) -> Schedule:
    v = (rank - root) % p
    steps = []
    mask = 1
    while mask < p:
        if v & mask:
            steps.append(Step(sends=(Xfer((v - mask + root) % p, buf, 0, n),)))
            break
        if v + mask < p:
            steps.append(Step(recvs=(Xfer((v + mask + root) % p, buf, 0, n, reduce=True),)))
        mask <<= 1
    return steps


def broadcast_steps(rank: int, p: int, root: int, buf: str, n: int) -> Schedule:
    v = (rank - root) % p
    steps = []
    mask = 1
    while mask < p:
        if v & mask:
            steps.append(Step(recvs=(Xfer((v - mask + root) % p, buf, 0, n),)))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            steps.append(Step(sends=(Xfer((v + mask + root) % p, buf, 0, n),)))
        mask >>= 1
    return steps


def reduce(spec: Spec) -> Schedule:
    return reduce_steps(spec.rank, spec.size, spec.root, "out", spec.count)


def broadcast(spec: Spec) -> Schedule:
    return broadcast_steps(spec.rank, spec.size, spec.root, "out", spec.count)


def allreduce(spec: Spec) -> Schedule:
    return (reduce_steps(spec.rank, spec.size, 0, "out", spec.count)
            + broadcast_steps(spec.rank, spec.size, 0, "out", spec.count))
