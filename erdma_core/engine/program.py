"""A checked plan compiled for one group and one message size: every message it sends or receives, cut into
chunks, with the peer's global rank and its tag worked out once. The executor then runs a collective by
walking these tuples; nothing per call depends on the schedule's shape beyond them.

Tags: the k-th message this rank sends to a peer carries tag k, and the k-th receive it posts from that peer
expects tag k (both sides cut slices into the same chunks, and receives are posted in step order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ..algorithms.schedule import Copy, Xfer
from .plans import Plan


class Msg(NamedTuple):
    """One message (a chunk of a transfer)."""

    peer: int  # group rank
    to: int  # global rank: the transport's address for it
    tag: int
    buf: str
    offset: int
    count: int
    nbytes: int
    reduce: bool  # a receive combined into its target (it lands in scratch memory first)
    scratch: int  # a reducing receive: its offset in the step's scratch, in elements


class Stage(NamedTuple):
    """One step: local copies, then receives and sends."""

    copies: tuple[Copy, ...]
    recvs: tuple[Msg, ...]
    sends: tuple[Msg, ...]
    scratch: int  # elements of scratch memory its reducing receives need
    early: bool  # its receives may be posted while the step before it runs
    sends_copied: bool  # it copies and sends (a lossy compressor encodes such copies first)


class Program(NamedTuple):
    stages: tuple[Stage, ...]


def chunks(offset: int, count: int, chunk: int) -> list[tuple[int, int]]:
    """``[offset, offset + count)`` cut into pieces of at most ``chunk`` elements."""
    if count <= chunk:
        return [(offset, count)]
    end = offset + count
    return [(o, min(chunk, end - o)) for o in range(offset, end, chunk)]


def compile_plan(plan: Plan, ranks: Sequence[int], chunk_elems: int, itemsize: int) -> Program:
    """``plan`` for a group whose rank i is global rank ``ranks[i]``, messages cut at ``chunk_elems``."""
    chunk = max(1, chunk_elems)
    sent: dict[int, int] = {}
    received: dict[int, int] = {}

    def msgs(xs: Sequence[Xfer], counters: dict[int, int], is_recv: bool) -> tuple[tuple[Msg, ...], int]:
        out, used = [], 0
        for x in xs:
            for off, cnt in chunks(x.offset, x.count, chunk):
                tag = counters.get(x.peer, 0)
                counters[x.peer] = tag + 1
                reduce = is_recv and x.reduce
                out.append(Msg(x.peer, ranks[x.peer], tag, x.buf, off, cnt, cnt * itemsize, reduce,
                               used if reduce else 0))
                if reduce:
                    used += cnt
        return tuple(out), used

    stages = []
    for step, early in zip(plan.steps, plan.early, strict=True):
        recvs, scratch = msgs(step.recvs, received, True)
        sends, _ = msgs(step.sends, sent, False)
        stages.append(Stage(step.copies, recvs, sends, scratch, early, bool(step.copies and step.sends)))
    return Program(tuple(stages))
