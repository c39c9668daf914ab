"""Broadcast for large messages (van de Geijn): the root scatters one slice to each rank, then a ring
allgather completes every copy. The root sends 2(p-1)/p of the message instead of a binomial tree's log2(p)
whole copies, and every rank's link carries the same share.
"""

from __future__ import annotations

from .ring import allgather_steps
from .schedule import Schedule, Spec, Step, Xfer, bounds, seg


def broadcast(spec: Spec) -> Schedule:
    p, root, n = spec.size, spec.root, spec.count
    if p == 1:
        return []
    b = bounds(n, p)  # slice v belongs to virtual rank v = (rank - root) % p
    v = (spec.rank - root) % p
    if v == 0:
        scatter = Step(sends=tuple(Xfer((w + root) % p, "out", *seg(b, w)) for w in range(1, p) if b[w + 1] > b[w]))
    else:
        scatter = Step(recvs=(Xfer(root, "out", *seg(b, v)),) if b[v + 1] > b[v] else ())
    return [scatter, *allgather_steps(spec.rank, p, b, "out", -root)]
