"""Runs a rank's plan on a transport: the only place where algorithms meet the network.

Per step: local copies, then every receive is posted (reducing receives land in scratch memory), then the
sends go out chunk by chunk; between chunks, receives that have landed are reduced in schedule order, so
reduction overlaps the transfer. Messages larger than ``chunk_elems`` are split; both sides split the same
way, so chunk k of a slice meets chunk k. With a compressor (``codecs``), a chunk of at least ``min_bytes``
leaves encoded and is decoded where it lands, before any reduction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence

import attrs
import numpy as np

from ..algorithms.schedule import Step, Xfer
from ..compression import Site
from ..errors import CollectiveError, CollectiveTimeoutError, ErdmaError, ProtocolError
from ..transport.base import Transport
from ..transport.mailbox import Request, as_bytes
from ..transport.wire import DATA, RAW, Header
from . import reduce_ops
from .codecs import MIXED, OWN, Codecs, Forwarding, Outgoing
from .plans import Plan
from .reduce_ops import ReduceOp

ScratchFor = Callable[[int, np.dtype, int], np.ndarray]
_NO_CODECS = Codecs(None, 0, lambda cid: None)


@attrs.define(kw_only=True)
class Op:
    """One collective's identity on the wire, its limits and, for error feedback, the caller's buffer
    identity (``key``; None: no stable identity)."""

    name: str
    opcode: int
    dtype: str
    dtype_code: int
    numel: int
    job: int
    group: int
    seq: int
    reduce_op: ReduceOp | None
    timeout: float
    chunk_elems: int
    ranks: Sequence[int]
    rank: int
    algorithm: str = ""
    key: Hashable | None = None
    deadline: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout
        self.chunk_elems = max(1, self.chunk_elems)

    def header(self, tag: int, count: int, nbytes: int, codec: int = RAW, meta: int = 0) -> Header:
        return Header(kind=DATA, job=self.job, dtype=self.dtype_code, opcode=self.opcode,
                      redop=self.reduce_op.code if self.reduce_op else 0, group=self.group, seq=self.seq, tag=tag,
                      codec=codec, meta=meta, numel=self.numel, count=count, nbytes=nbytes)


def _chunks(x: Xfer, chunk: int) -> list[tuple[int, int]]:
    if x.count <= chunk:
        return [(x.offset, x.count)]
    return [(o, min(chunk, x.offset + x.count - o)) for o in range(x.offset, x.offset + x.count, chunk)]


def run(plan: Plan, buffers: Mapping[str, np.ndarray], transport: Transport, op: Op,
        scratch_for: ScratchFor | None = None, codecs: Codecs = _NO_CODECS) -> None:
    """Execute ``plan``; raise a CollectiveError naming this rank, the op and the peer on failure.

    ``scratch_for(count, dtype, slot)`` lends the memory reducing receives land in (slots 0 and 1, used by
    alternate steps). The next step's receives are posted before this step's sends whenever the plan says
    that is safe, so a fast neighbour's data lands in place instead of being buffered.
    """
    counters: tuple[dict[int, int], dict[int, int]] = ({}, {})  # messages sent to / received from each rank
    itemsize = buffers["out"].itemsize
    fwd = Forwarding() if codecs.lossy else None
    steps, early = plan.steps, plan.early
    posted: list[_Pending] | None = None
    for i, step in enumerate(steps):
        for c in step.copies:
            buffers[c.dst][c.dst_offset:c.dst_offset + c.count] = buffers[c.src][c.src_offset:c.src_offset + c.count]
            if fwd is not None:
                fwd.copied(c.src, c.src_offset, c.dst, c.dst_offset, c.count)
        exchanged: list[tuple[int, str, int, int]] = []
        if fwd is not None and step.copies and step.sends:
            exchanged = _encode_copies(step, i, buffers, op, codecs, fwd)
        pending = posted if posted is not None else _post(step, i % 2, buffers, transport, op, counters[1],
                                                          itemsize, scratch_for)
        posted = None
        if i + 1 < len(steps) and early[i + 1]:
            posted = _post(steps[i + 1], (i + 1) % 2, buffers, transport, op, counters[1], itemsize, scratch_for)
        done = 0
        for x in step.sends:
            g = op.ranks[x.peer]
            for off, cnt in _chunks(x, op.chunk_elems):
                tag = counters[0].get(g, 0)
                counters[0][g] = tag + 1
                codec, meta, payload = _outgoing(codecs, fwd, op, i, x.buf, buffers[x.buf], off, cnt)
                req = transport.isend(g, op.header(tag, cnt, len(payload), codec, meta), payload, op.deadline)
                finish(req, x.peer, op, transport, "sending to")
                while done < len(pending) and pending[done][0].done():
                    _land(pending[done], buffers, op, transport, codecs, fwd, exchanged)
                    done += 1
        for item in pending[done:]:
            _land(item, buffers, op, transport, codecs, fwd, exchanged)


_Pending = tuple[Request, Xfer, int, int, "np.ndarray | None"]


def _outgoing(codecs: Codecs, fwd: Forwarding | None, op: Op, step: int, buf: str, arr: np.ndarray, off: int,
              cnt: int) -> Outgoing:
    """What goes on the wire for ``arr[off:off+cnt]``: raw, forwarded as it came, or encoded afresh."""
    view = arr[off:off + cnt]
    if codecs.sender is None or view.nbytes < codecs.min_bytes:
        if fwd is not None and buf != "in":
            fwd.record(buf, off, off + cnt, None)  # a peer now holds these exact values
        return RAW, 0, as_bytes(view)
    if fwd is not None and buf != "in":
        found = fwd.lookup(buf, off, off + cnt)
        if found is MIXED or found is None:
            fwd.record(buf, off, off + cnt, None)
            return RAW, 0, as_bytes(view)
        if found is not OWN:
            return found  # type: ignore[no-any-return]
    site = Site(op.key, op.name, op.algorithm, step, off, cnt) if op.key is not None else None
    out = codecs.encode(view, op.dtype, site)
    if out is None:
        if fwd is not None and buf != "in":
            fwd.record(buf, off, off + cnt, None)
        return RAW, 0, as_bytes(view)
    if fwd is not None and buf != "in":
        codecs.decode_own(out, op.dtype, view)  # this rank keeps what its peers will see
        fwd.record(buf, off, off + cnt, out)
    return out


def _encode_copies(step: Step, i: int, buffers: Mapping[str, np.ndarray], op: Op, codecs: Codecs,
                   fwd: Forwarding) -> list[tuple[int, str, int, int]]:
    """Lossy compressor: a step that sends a copy (``Copy('out', ..., 'work', ...)``, then send 'work') encodes
    it now, before any receive of the step lands, and the copy's source takes the decoded values too. A rank
    that sends its elements and also reduces into them (recursive doubling) then combines the same values its
    peer received; the sends below forward these bytes. Returns the source ranges so exchanged, with the
    peer: ``(peer, buffer, start, end)``."""
    exchanged = []
    for x in step.sends:
        for c in step.copies:
            if c.dst != x.buf or c.src == "in":
                continue
            for off, cnt in _chunks(x, op.chunk_elems):
                if not (c.dst_offset <= off and off + cnt <= c.dst_offset + c.count):
                    continue
                src = c.src_offset + off - c.dst_offset
                exchanged.append((x.peer, c.src, src, src + cnt))
                if fwd.lookup(x.buf, off, off + cnt) is OWN:
                    out = _outgoing(codecs, fwd, op, i, x.buf, buffers[x.buf], off, cnt)
                    buffers[c.src][src:src + cnt] = buffers[x.buf][off:off + cnt]
                    fwd.record(c.src, src, src + cnt, out if out[0] != RAW else None)
    return exchanged


def _post(step: Step, slot: int, buffers: Mapping[str, np.ndarray], transport: Transport, op: Op,
          received: dict[int, int], itemsize: int, scratch_for: ScratchFor | None) -> list[_Pending]:
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
            req = transport.irecv(g, op.header(tag, cnt, cnt * itemsize), as_bytes(land))
            pending.append((req, x, off, cnt, land if x.reduce else None))
    return pending


def _land(item: _Pending, buffers: Mapping[str, np.ndarray], op: Op, transport: Transport, codecs: Codecs,
          fwd: Forwarding | None, exchanged: Sequence[tuple[int, str, int, int]] = ()) -> None:
    req, x, off, cnt, scratch = item
    finish(req, x.peer, op, transport, "waiting for")
    target = scratch if scratch is not None else buffers[x.buf][off:off + cnt]
    if req.encoded is not None:
        header, payload = req.encoded
        decode(codecs, header, payload, target, op, transport, x.peer)
        if fwd is not None and scratch is None:
            fwd.record(x.buf, off, off + cnt, (header.codec, header.meta, payload))
    elif fwd is not None and scratch is None:
        fwd.record(x.buf, off, off + cnt, None)
    if scratch is not None:
        assert op.reduce_op is not None
        reduce_ops.reduce_into(buffers[x.buf][off:off + cnt], scratch, op.reduce_op, op.dtype)
        if fwd is not None:
            # the elements are this rank's own now, unless it exchanged them with this peer in this step: then
            # the peer holds the same sum, and a later send of it must go raw (an encoder's state differs
            # from rank to rank, so two ranks encoding the same values need not agree)
            same = any(p == x.peer and b == x.buf and lo <= off and off + cnt <= hi for p, b, lo, hi in exchanged)
            if same:
                fwd.record(x.buf, off, off + cnt, None)
            else:
                fwd.forget(x.buf, off, off + cnt)


def decode(codecs: Codecs, header: Header, payload: memoryview, out: np.ndarray, op: Op, transport: Transport,
           peer: int) -> None:
    """Decode a message from group rank ``peer``; a payload that cannot be decoded fails the job."""
    try:
        codecs.decode(header, payload, op.dtype, out, op.rank, op.ranks[peer])
    except ProtocolError as exc:
        err = ProtocolError(f"{op.name} (group {op.group}, seq {op.seq}) failed on rank {op.rank}: {exc}")
        transport.abort(err)
        raise err from exc


def finish(req: Request, peer: int, op: Op, transport: Transport, doing: str) -> None:
    try:
        ok = (req.done() and req.error is None) or transport.wait(req, op.deadline)
    except CollectiveError as exc:
        transport.abort(exc)
        raise type(exc)(f"{op.name} (group {op.group}, seq {op.seq}) failed on rank {op.rank}: {exc}",
                        **_fields(exc, op)) from exc
    except ErdmaError as exc:  # a peer broke the protocol, or this rank could not send
        transport.abort(exc)
        raise
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
