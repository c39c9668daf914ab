"""Schedules: the pure description of a collective, apart from any network.

A ``Schedule`` is the list of ``Step``s one rank runs. In a step the rank first makes its local ``copies``,
then posts every receive, sends every send, and waits for all; receives marked ``reduce`` are combined
into their target in the order listed. Buffers are named: ``in`` (the caller's input), ``out`` (the
result; the caller's tensor for in-place ops) and ``work`` (scratch of ``Spec.work_count`` elements).
Offsets and counts are in elements. The k-th message rank A sends to rank B meets the k-th receive B
posts from A, so schedules need no tags.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Xfer:
    peer: int
    buf: str
    offset: int
    count: int
    reduce: bool = False


@attrs.frozen
class Copy:
    src: str
    src_offset: int
    dst: str
    dst_offset: int
    count: int


@attrs.frozen
class Step:
    sends: tuple[Xfer, ...] = ()
    recvs: tuple[Xfer, ...] = ()
    copies: tuple[Copy, ...] = ()


@attrs.frozen
class Spec:
    """What a schedule function is given. ``count``: elements per rank as the op defines it."""

    op: str
    rank: int
    size: int
    count: int
    root: int = 0
    send_counts: tuple[int, ...] = ()
    recv_counts: tuple[int, ...] = ()
    ps_servers: int = 1

    @property
    def work_count(self) -> int:
        return self.count * self.size if self.op == "reduce_scatter" else self.count


Schedule = list[Step]


def bounds(n: int, parts: int) -> list[int]:
    """Boundaries splitting ``n`` elements into ``parts`` near-equal slices (the first ones one larger)."""
    q, r = divmod(n, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + q + (1 if i < r else 0))
    return out


def seg(b: list[int], i: int) -> tuple[int, int]:
    return b[i], b[i + 1] - b[i]
