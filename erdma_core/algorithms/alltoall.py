"""All-to-all with per-peer split sizes: pairwise exchange, and the seeds' sequential exchange.

``in`` holds the blocks for ranks 0..p-1 back to back (``send_counts``); ``out`` receives the blocks from
ranks 0..p-1 back to back (``recv_counts``).
"""

from __future__ import annotations

from itertools import accumulate

from .schedule import Copy, Schedule, Spec, Step, Xfer


def _offsets(counts: tuple[int, ...]) -> list[int]:
    return [0, *accumulate(counts)]


def _own(spec: Spec) -> Step:
    so, ro, r = _offsets(spec.send_counts), _offsets(spec.recv_counts), spec.rank
    return Step(copies=(Copy("in", so[r], "out", ro[r], spec.send_counts[r]),))


def _exchange(spec: Spec, to: int, frm: int) -> Step:
    so, ro = _offsets(spec.send_counts), _offsets(spec.recv_counts)
    return Step(sends=(Xfer(to, "in", so[to], spec.send_counts[to]),),
                recvs=(Xfer(frm, "out", ro[frm], spec.recv_counts[frm]),))


def pairwise(spec: Spec) -> Schedule:
    """Step k: send to rank r+k, receive from rank r-k. Every link busy, p-1 steps."""
    p, r = spec.size, spec.rank
    return [_own(spec)] + [_exchange(spec, (r + k) % p, (r - k) % p) for k in range(1, p)]


def linear(spec: Spec) -> Schedule:
    """One step: every block sent and every receive posted at once (MPI's basic linear algorithm). One wait
    instead of p-1, so small messages pay one round of latency; every rank sends p-1 blocks back to back."""
    p, r = spec.size, spec.rank
    so, ro = _offsets(spec.send_counts), _offsets(spec.recv_counts)
    order = [(r + k) % p for k in range(1, p)]  # rank r+1 first: the ranks do not all send to rank 0 first
    return [Step(copies=_own(spec).copies,
                 sends=tuple(Xfer(q, "in", so[q], spec.send_counts[q]) for q in order),
                 recvs=tuple(Xfer(q, "out", ro[q], spec.recv_counts[q]) for q in reversed(order)))]


def sequential(spec: Spec) -> Schedule:
    """One pair at a time, in strict order (0,1), (0,2), ..., (p-2,p-1).

    Only one pair's blocks are on the network at any moment: predictable load and the lowest peak memory
    in flight, at the price of p(p-1)/2 serialized exchanges. The lower rank of each pair hands a
    zero-byte token to the ranks of the next pair, which wait for it before exchanging.
    """
    p, r = spec.size, spec.rank
    pairs = [(i, j) for i in range(p) for j in range(i + 1, p)]
    steps = [_own(spec)]
    for t, (i, j) in enumerate(pairs):
        if t > 0:
            prev_leader = pairs[t - 1][0]
            if r in (i, j) and r != prev_leader:
                steps.append(Step(recvs=(Xfer(prev_leader, "out", 0, 0),)))
        if r in (i, j):
            other = j if r == i else i
            steps.append(_exchange(spec, other, other))
        if r == i and t + 1 < len(pairs):
            nxt = {x for x in pairs[t + 1] if x != r}
            steps.append(Step(sends=tuple(Xfer(x, "in", 0, 0) for x in sorted(nxt))))
    return steps
