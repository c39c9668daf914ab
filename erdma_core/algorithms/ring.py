"""Ring algorithms: reduce-scatter, allgather and their sum, the bandwidth-optimal allreduce.

Each of the p-1 steps sends one slice to the right neighbour and receives one from the left; the executor
splits large slices into chunks and reduces each chunk as it lands, so reduction overlaps the transfer.
"""

from __future__ import annotations

from .schedule import Copy, Schedule, Spec, Step, Xfer, bounds, seg


def reduce_scatter_steps(rank: int, p: int, b: list[int], buf: str, owned_shift: int) -> Schedule:
    """After these steps rank r holds the full reduction of slice ``(r + owned_shift) % p``."""
    right, left = (rank + 1) % p, (rank - 1) % p
    steps = []
    for s in range(p - 1):
        send_i = (rank + owned_shift - s - 1) % p
        recv_i = (rank + owned_shift - s - 2) % p
        steps.append(Step(sends=(Xfer(right, buf, *seg(b, send_i)),),
                          recvs=(Xfer(left, buf, *seg(b, recv_i), reduce=True),)))
    return steps


def allgather_steps(rank: int, p: int, b: list[int], buf: str, owned_shift: int) -> Schedule:
    """Rank r starts holding slice ``(r + owned_shift) % p`` and ends holding every slice."""
    right, left = (rank + 1) % p, (rank - 1) % p
    return [Step(sends=(Xfer(right, buf, *seg(b, (rank + owned_shift - s) % p)),),
                 recvs=(Xfer(left, buf, *seg(b, (rank + owned_shift - s - 1) % p)),))
            for s in range(p - 1)]


def allreduce(spec: Spec) -> Schedule:
    b = bounds(spec.count, spec.size)
    return (reduce_scatter_steps(spec.rank, spec.size, b, "out", 1)
            + allgather_steps(spec.rank, spec.size, b, "out", 1))


def reduce_scatter(spec: Spec) -> Schedule:
    """``in`` holds p slices of ``count``; rank r ends with the reduction of slice r in ``out``."""
    p, n = spec.size, spec.count
    b = [i * n for i in range(p + 1)]
    first = Step(copies=(Copy("in", 0, "work", 0, n * p),))
    last = Step(copies=(Copy("work", spec.rank * n, "out", 0, n),))
    return [first, *reduce_scatter_steps(spec.rank, p, b, "work", 0), last]


def allgather(spec: Spec) -> Schedule:
    """``in`` holds ``count`` elements; ``out`` ends with every rank's input in rank order."""
    p, n = spec.size, spec.count
    b = [i * n for i in range(p + 1)]
    first = Step(copies=(Copy("in", 0, "out", spec.rank * n, n),))
    return [first, *allgather_steps(spec.rank, p, b, "out", 0)]
