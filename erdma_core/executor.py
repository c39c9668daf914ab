"""Runs a rank's schedule on a transport: the only place where algorithms meet the network.

Per step: local copies, then every receive is posted (reducing receives land in scratch memory), then the
sends go out chunk by chunk; between chunks, receives that have landed are reduced in schedule order, so
reduction overlaps the transfer. Messages larger than ``chunk_elems`` are split; both sides split the same
way, so chunk k of a slice meets chunk k.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from . import reduce_ops
from .algorithms.schedule import Schedule, Xfer
from .errors import CollectiveError, CollectiveTimeoutError
from .mailbox import Request, as_bytes
from .reduce_ops import ReduceOp
from .transport.base import Transport
from .wire import DATA, Header


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


def run(schedule: Schedule, buffers: Mapping[str, np.ndarray], transport: Transport, op: Op,
        scratch_for: Callable[[int, np.dtype], np.ndarray] | None = None) -> None:
    """Execute ``schedule``; raise a CollectiveError naming this rank, the op and the peer on failure.
    ``scratch_for(count, dtype)`` lends the memory reducing receives land in (reused step after step)."""
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    itemsize = next(iter(buffers.values())).itemsize
    for step in schedule:
        for c in step.copies:
            buffers[c.dst][c.dst_offset:c.dst_offset + c.count] = buffers[c.src][c.src_offset:c.src_offset + c.count]
        pending: list[tuple[Request, Xfer, int, int, np.ndarray | None]] = []
        need = sum(x.count for x in step.recvs if x.reduce)
        scratch = scratch_for(need, buffers["out"].dtype) if scratch_for else np.empty(need, buffers["out"].dtype)
        used = 0
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
        done = 0
        for x in step.sends:
            g = op.ranks[x.peer]
            for off, cnt in _chunks(x, op.chunk_elems):
                tag = sent.get(g, 0)
                sent[g] = tag + 1
                req = transport.isend(g, _header(op, tag, cnt * itemsize), as_bytes(buffers[x.buf][off:off + cnt]),
                                      op.deadline)
                finish(req, x.peer, op, transport, "sending to")
                while done < len(pending) and pending[done][0].done():
                    _land(pending[done], buffers, op, transport)
                    done += 1
        for item in pending[done:]:
            _land(item, buffers, op, transport)


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
            f"rank {op.rank}: {op.name} (group {op.group}, seq {op.seq}) timed out after {op.timeout:.1f}s "
            f"{doing} rank {op.ranks[peer]}", rank=op.rank, op=op.name)
        transport.abort(err)
        raise err


def _fields(exc: CollectiveError, op: Op) -> dict[str, object]:
    fields: dict[str, object] = {"rank": op.rank, "op": op.name}
    if hasattr(exc, "peer"):
        fields["peer"] = exc.peer
    return fields
