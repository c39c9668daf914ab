"""A checked plan compiled for one group and one message size: every message it sends or receives, cut into
chunks, with the peer's global rank and its tag worked out once. The executor then runs a collective by
walking these tuples; nothing per call depends on the schedule's shape beyond them.

Tags: the k-th message this rank sends to a peer carries tag k, and the k-th receive it posts from that peer
expects tag k (both sides cut slices into the same chunks, and receives are posted in step order).

Copies only there to be sent are left out (``elide``): a schedule copies what it sends into ``work`` when
the step also reduces into the original (recursive doubling does, every step), since algorithms may not
assume how the executor orders a step's sends and receives. This executor writes a step's single message
completely before it reduces anything the step received (reducing receives land in scratch memory), so that
message can be read from the original, unless a receive lands there directly meanwhile. That saves a copy
of the whole message per step, on some hosts a far slower one than its size suggests (see
``buffers.page_aligned``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from ..algorithms.schedule import Copy, Xfer
from .plans import Plan, touches_work


class Msg(NamedTuple):
    """One message (a chunk of a transfer)."""

    peer: int  # group rank
    to: int  # global rank: the transport's address for it
    tag: int
    buf: str
    offset: int
    count: int  # type: ignore[assignment]  # (a field, shadowing tuple.count)
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
    after_sends: bool  # else, once the step before has sent everything (see ``plans.lookahead``)
    sends_copied: bool  # it copies and sends (a lossy compressor encodes such copies first)


class Program(NamedTuple):
    stages: tuple[Stage, ...]
    uses_work: bool  # some stage still reads or writes the ``work`` buffer


def chunks(offset: int, count: int, chunk: int) -> list[tuple[int, int]]:
    """``[offset, offset + count)`` cut into pieces of at most ``chunk`` elements."""
    if count <= chunk:
        return [(offset, count)]
    end = offset + count
    return [(o, min(chunk, end - o)) for o in range(offset, end, chunk)]


STRIPE_FLOOR = 256 << 10  # bytes: chunks cut for a pool of connections are never smaller (unless asked for)


def chunk_bytes(configured: int, stripes: int) -> int:
    """The chunk size messages are cut at: ``collectives.chunk_bytes``, or over a transport that carries
    ``stripes`` messages to a peer side by side (``Transport.stripes``) that divided by ``stripes``, so that
    a message of ``configured`` bytes keeps them all busy, but not below ``STRIPE_FLOOR`` (nor above what was
    configured)."""
    if stripes <= 1:
        return configured
    return max(min(configured, STRIPE_FLOOR), configured // stripes)


def compile_plan(plan: Plan, ranks: Sequence[int], chunk_elems: int, itemsize: int, elide: bool = False) -> Program:
    """``plan`` for a group whose rank i is global rank ``ranks[i]``, messages cut at ``chunk_elems``;
    ``elide``: leave out copies into ``work`` that are only there to be sent (not with a lossy compressor,
    whose error feedback works on such copies)."""
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
    after = plan.after_sends or (False,) * len(plan.steps)
    for step, early, after_sends in zip(plan.steps, plan.early, after, strict=True):
        recvs, scratch = msgs(step.recvs, received, True)
        sends, _ = msgs(step.sends, sent, False)
        stages.append(Stage(step.copies, recvs, sends, scratch, early, after_sends and not early,
                            bool(step.copies and step.sends)))
    if elide and plan.uses_work and _only_sent(stages):
        stages = [_elided(st, nxt) for st, nxt in itertools.zip_longest(stages, stages[1:])]
        return Program(tuple(stages), any(touches_work(st) for st in stages))
    return Program(tuple(stages), plan.uses_work)


def _only_sent(stages: Sequence[Stage]) -> bool:
    """``work`` serves only as the copy a step sends: every step that touches it copies into it once and
    sends, in one message, only what that copy wrote; nothing is received into it or copied from it. Then
    no step reads what another wrote there, and each step's copy can go or stay on its own."""
    for st in stages:
        if not touches_work(st):
            continue
        if len(st.copies) != 1 or len(st.sends) != 1 or any(m.buf == "work" for m in st.recvs):
            return False
        c, m = st.copies[0], st.sends[0]
        if c.dst != "work" or c.src == "work" or m.buf != "work":
            return False
        if not (c.dst_offset <= m.offset and m.offset + m.count <= c.dst_offset + c.count):
            return False
    return True


def _elided(st: Stage, nxt: Stage | None) -> Stage:
    """``st`` sending from the copy's source instead of ``work``, when nothing lands there meanwhile (a
    receive of this step or of the next, which may be posted early, that is not reduced through scratch)."""
    if not touches_work(st):
        return st
    m, c = st.sends[0], st.copies[0]  # (as _only_sent found them)
    src = c.src_offset + m.offset - c.dst_offset
    landing = [r for r in (*st.recvs, *(nxt.recvs if nxt is not None and nxt.early else ())) if not r.reduce]
    if any(r.buf == c.src and r.offset < src + m.count and src < r.offset + r.count for r in landing):
        return st
    return st._replace(copies=(), sends=(m._replace(buf=c.src, offset=src),), sends_copied=False)
