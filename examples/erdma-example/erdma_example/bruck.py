"""Bruck's allgather: ceil(log2 p) steps for any world size (the ring needs p - 1). A rank gathers into
``work`` starting from its own block, so that block i of ``work`` is rank (r + i) % p's; in step k it sends
the first 2^k blocks it holds to rank r - 2^k and receives as many from rank r + 2^k behind them. A last
step rotates ``work`` into ``out`` (block q of ``out`` is rank q's). What a step sends and what it receives
never overlap, as the executor requires."""

from __future__ import annotations

from erdma_core.sdk import Copy, Spec, Step, Xfer


def allgather(spec: Spec) -> list[Step]:
    p, r, n = spec.size, spec.rank, spec.count
    steps = [Step(copies=(Copy("in", 0, "work", 0, n),))]
    have = 1  # blocks gathered so far
    while have < p:
        take = min(have, p - have)
        steps.append(Step(sends=(Xfer((r - have) % p, "work", 0, take * n),),
                          recvs=(Xfer((r + have) % p, "work", have * n, take * n),)))
        have += take
    steps.append(Step(copies=tuple(Copy("work", i * n, "out", ((r + i) % p) * n, n) for i in range(p))))
    return steps
