"""Runs a rank's schedule on a transport: the only place where algorithms meet the network.

Per step: local copies, then every receive is posted (reducing receives land in scratch memory), then the
sends go out chunk by chunk; between chunks, receives that have landed are reduced in schedule order, so
reduction overlaps the transfer. Messages larger than ``chunk_elems`` are split; both sides split the same
way, so chunk k of a slice meets chunk k.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..algorithms.schedule import Step, Xfer
from ..errors import CollectiveError, CollectiveTimeoutError
from ..transport.base import Transport
from ..transport.mailbox import Request, as_bytes
from ..transport.wire import DATA, Header
from . import reduce_ops
from .reduce_ops import ReduceOp


class Op:
    """One collective's identity on the wire and its limits."""

    __slots__ = (
        "chunk_elems",
        "deadline",
        "dtype",
        "dtype_code",
        "group",
        "job",
        "name",
        "numel",
        "opcode",
        "rank",
        "ranks",
        "reduce_op",
        "seq",
        "timeout",
    )

    def __init__(self, name: str, opcode: int, dtype: str, dtype_code: int, numel: int, job: int, group: int,
                 seq: int, reduce_op: ReduceOp | None, timeout: float, chunk_elems: int, ranks: Sequence[int],
                 rank: int) -> None:
        self.name, self.opcode, self.dtype, self.dtype_code = name, opcode, dtype, dtype_code
        self.numel, self.job, self.group, self.seq = numel, job, group, seq
        self.reduce_op, self.timeout, self.chunk_elems = reduce_op, timeout, max(1, chunk_elems)
        self.deadline = time.monotonic() + timeout
        self.ranks, self.rank = ranks, rank


def _chunks(x: Xfer, chunk: int) -> list[tuple[int, int]]:
    if x.count <= chunk:
        return [(x.offset, x.count)]
    return [(o, min(chunk, x.offset + x.count - o)) for o in range(x.offset, x.offset + x.count, chunk)]


def run(schedule: Sequence[Step], buffers: Mapping[str, np.ndarray], transport: Transport, op: Op,
        scratch_for: Callable[[int, np.dtype, int], np.ndarray] | None = None,
        early: Sequence[bool] | None = None) -> None:
    """Execute ``schedule``; raise a CollectiveError naming this rank, the op and the peer on failure.

    ``scratch_for(count, dtype, slot)`` lends the memory reducing receives land in (two slots, used by
    alternate steps). The next step's receives are posted before this step's sends whenever
    ``early`` (``lookahead(schedule)``, best computed once with the schedule) says that is safe, so a fast
    neighbour's data lands in place instead of being buffered.
    """
    counters: tuple[dict[int, int], dict[int, int]] = ({}, {})  # messages sent to / received from each rank
    itemsize = next(iter(buffers.values())).itemsize
    if early is None:
        early = lookahead(tuple(schedule))
    posted: list[tuple[Request, Xfer, int, int, np.ndarray | None]] | None = None
    for i, step in enumerate(schedule):
        for c in step.copies:
            buffers[c.dst][c.dst_offset:c.dst_offset + c.count] = buffers[c.src][c.src_offset:c.src_offset + c.count]
        pending = posted if posted is not None else _post(step, i % 2, buffers, transport, op, counters[1],
                                                          itemsize, scratch_for)
        posted = None
        if i + 1 < len(schedule) and early[i + 1]:
            posted = _post(schedule[i + 1], (i + 1) % 2, buffers, transport, op, counters[1], itemsize, scratch_for)
        done = 0
        for x in step.sends:
            g = op.ranks[x.peer]
            for off, cnt in _chunks(x, op.chunk_elems):
                tag = counters[0].get(g, 0)
                counters[0][g] = tag + 1
                req = transport.isend(g, _header(op, tag, cnt * itemsize), as_bytes(buffers[x.buf][off:off + cnt]),
                                      op.deadline)
                finish(req, x.peer, op, transport, "sending to")
                while done < len(pending) and pending[done][0].done():
                    _land(pending[done], buffers, op, transport)
                    done += 1
        for item in pending[done:]:
            _land(item, buffers, op, transport)


def _post(step: Step, slot: int, buffers: Mapping[str, np.ndarray], transport: Transport, op: Op,
          received: dict[int, int], itemsize: int,
          scratch_for: Callable[[int, np.dtype, int], np.ndarray] | None) -> list[Any]:
    dtype = buffers["out"].dtype
    need = sum(x.count for x in step.recvs if x.reduce)
    scratch = scratch_for(need, dtype, slot) if scratch_for else np.empty(need, dtype)
    used, pending = 0, []
    for x in step.recvs:
        g = op.ranks[x.peer]
        for off, cnt in _chunks(x, op.chunk_elems):
            if x.reduce:
                land = scratch[used:used + cnt]
                used += cnt
            else:
                land = buffers[x.buf][off:off + cnt]
            tag = received.get(g, 0)
            received[g] = tag + 1
            req = transport.irecv(g, _header(op, tag, cnt * itemsize), as_bytes(land))
            pending.append((req, x, off, cnt, land if x.reduce else None))
    return pending


def lookahead(schedule: tuple[Step, ...]) -> tuple[bool, ...]:
    """For each step: may its receives be posted while the step before it is still running? Yes when it
    makes no local copies and its in-place receives touch nothing the previous step reads or writes."""

    def spans(xs: Sequence[Xfer]) -> list[tuple[str, int, int]]:
        return [(x.buf, x.offset, x.offset + x.count) for x in xs]

    out = [False]
    for prev, step in itertools.pairwise(schedule):
        busy = spans(prev.sends) + spans(prev.recvs) + [(c.dst, c.dst_offset, c.dst_offset + c.count)
                                                         for c in prev.copies]
        mine = spans([x for x in step.recvs if not x.reduce])
        clash = any(b == m and lo < mhi and mlo < hi for b, lo, hi in busy for m, mlo, mhi in mine)
        out.append(not step.copies and not clash)
    return tuple(out)


def _header(op: Op, tag: int, nbytes: int) -> Header:
    flags = op.reduce_op.code if op.reduce_op else 0
    return Header(DATA, op.dtype_code, op.opcode, flags, op.job, op.group, op.seq, tag, op.numel, nbytes)


def _land(item: tuple[Request, Xfer, int, int, np.ndarray | None], buffers: Mapping[str, np.ndarray], op: Op,
          transport: Transport) -> None:
    req, x, off, cnt, scratch = item
    finish(req, x.peer, op, transport, "waiting for")
    if scratch is not None:
        assert op.reduce_op is not None
        reduce_ops.reduce_into(buffers[x.buf][off:off + cnt], scratch, op.reduce_op, op.dtype)


def finish(req: Request, peer: int, op: Op, transport: Transport, doing: str) -> None:
    try:
        ok = req.wait(op.deadline)
    except CollectiveError as exc:
        transport.abort(exc)
        raise type(exc)(f"{op.name} (group {op.group}, seq {op.seq}) failed on rank {op.rank}: {exc}",
                        **_fields(exc, op)) from exc
    if not ok:
        err = CollectiveTimeoutError(
            f"rank {op.rank}: {op.name} (group {op.group}, seq {op.seq}) hit its timeout of {op.timeout:.1f}s "
            f"{doing} rank {op.ranks[peer]}", rank=op.rank, op=op.name)
        transport.abort(err)
        raise err


def _fields(exc: CollectiveError, op: Op) -> dict[str, object]:
    fields: dict[str, object] = {"rank": op.rank, "op": op.name}
    if hasattr(exc, "peer"):
        fields["peer"] = exc.peer
    return fields
