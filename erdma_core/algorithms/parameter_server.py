"""Parameter-server allreduce (the lecture's PS): every rank pushes, servers reduce, every rank pulls.

One round each way, but the servers' fan-in is p-1: O(N*P) bytes through each server. The buffer is
split into ``servers`` shards (option ``[algorithm.allreduce.parameter_server] servers``); shard i is served
by rank i. Pushes are reduced in rank order.
"""

from __future__ import annotations

from .schedule import Schedule, Spec, Step, Xfer, bounds, seg


def allreduce(spec: Spec) -> Schedule:
    p, r = spec.size, spec.rank
    k = min(spec.options["servers"], p)
    b = bounds(spec.count, k)
    push_sends = tuple(Xfer(s, "out", *seg(b, s)) for s in range(k) if s != r)
    pull_recvs = tuple(Xfer(s, "out", *seg(b, s)) for s in range(k) if s != r)
    push_recvs: tuple[Xfer, ...] = ()
    pull_sends: tuple[Xfer, ...] = ()
    if r < k:
        push_recvs = tuple(Xfer(q, "out", *seg(b, r), reduce=True) for q in range(p) if q != r)
        pull_sends = tuple(Xfer(q, "out", *seg(b, r)) for q in range(p) if q != r)
    return [Step(sends=push_sends, recvs=push_recvs), Step(sends=pull_sends, recvs=pull_recvs)]
