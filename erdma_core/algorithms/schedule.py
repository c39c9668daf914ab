"""Schedules: the pure description of a collective, apart from any network.

A ``Schedule`` is the list of ``Step``s one rank runs. In a step the rank first makes its local ``copies``
(in order), then posts every receive, sends every send, and waits for all; receives marked ``reduce`` are
combined into their target in the order listed. Buffers are named: ``in`` (the caller's input, read-only),
``out`` (the result; the caller's tensor for in-place ops) and ``work`` (scratch of ``Spec.work_count``
elements, the larger of ``in`` and ``out``). Offsets and counts are in elements. The k-th message rank A
sends to rank B meets the k-th receive B posts from A, so schedules need no tags.

A step's sends may still be reading while its receives land (the executor reduces each receive as it
arrives, between the pieces of the sends), so within a step no send may overlap a receive's target and no
two receives may overlap unless both reduce; send from a copy in ``work`` instead. The executor checks
every schedule once (``erdma_core.engine.plans``) and refuses one that breaks these rules.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from ..protocol.ops import buffer_sizes


@attrs.frozen
class Options(Mapping[str, Any]):
    """An algorithm's options from its config section ``[algorithm.<op>.<name>]`` (hashable, so that
    schedules built from equal specs are built once)."""

    items_: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> Options:
        return cls(tuple(sorted(values.items())))

    def __getitem__(self, key: str) -> Any:
        for k, v in self.items_:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self.items_)

    def __len__(self) -> int:
        return len(self.items_)


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
    """What a schedule function is given. ``count``: elements per rank as the op defines it; ``root`` for
    rooted ops; per-peer element counts for alltoall; the algorithm's ``options``."""

    op: str
    rank: int
    size: int
    count: int
    root: int = 0
    send_counts: tuple[int, ...] = ()
    recv_counts: tuple[int, ...] = ()
    options: Options = Options()

    @property
    def work_count(self) -> int:
        return buffer_sizes(self)["work"]


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
