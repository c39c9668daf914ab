"""Runs a rank's program (its plan compiled for the group and the size, ``program.py``) on a transport: the
only place where algorithms meet the network.

Per step: local copies, then every receive is posted (reducing receives land in scratch memory), then the
sends go out chunk by chunk; between chunks, receives that have landed are reduced in schedule order, so
reduction overlaps the transfer. Messages larger than the chunk size were split when the program was
compiled; both sides split the same way, so chunk k of a slice meets chunk k. With a compressor
(``codecs``), a chunk of at least ``min_bytes`` leaves encoded and is decoded where it lands, before any
reduction.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import NamedTuple

import numpy as np

from ..compression import Site
from ..errors import AbortedError, CollectiveError, CollectiveTimeoutError, ErdmaError, ProtocolError
from ..protocol import reduce_ops
from ..protocol.reduce_ops import ReduceOp
from ..transport.base import Transport
from ..transport.mailbox import as_bytes
from ..transport.request import Request
from ..transport.wire import DATA, NO_ROOT, RAW, Header, make_header
from .codecs import MIXED, OWN, Codecs, Forwarding, Outgoing
from .program import Msg, Program, Stage

ScratchFor = Callable[[int, np.dtype, int], np.ndarray]
_NO_CODECS = Codecs(None, 0, lambda cid: None)


class _OpFields(NamedTuple):
    name: str
    algorithm: str
    opcode: int
    dtype: str
    dtype_code: int
    numel: int
    job: int
    group: int
    label: str  # how errors name the group: "group 3", "group 1 (tp)"
    reduce_op: ReduceOp | None
    root: int  # the root's rank in the group (rooted ops), else wire.NO_ROOT
    timeout: float
    ranks: Sequence[int]
    rank: int
    head: tuple[int, ...]  # the first fields of every DATA header of the op (kind to group), worked out once
    seq: int
    key: Hashable | None
    deadline: float


class Op(_OpFields):
    """One collective's identity on the wire, its limits and, for error feedback, the caller's buffer
    identity (``key``; None: no stable identity). Built with keywords; ``again`` makes the next call's from
    a cached one (a new sequence number, key and deadline) for the price of a tuple."""

    __slots__ = ()

    def __new__(cls, *, name: str, opcode: int, dtype: str, dtype_code: int, numel: int, job: int, group: int,
                seq: int, reduce_op: ReduceOp | None, timeout: float, ranks: Sequence[int],
                rank: int, algorithm: str = "", key: Hashable | None = None, root: int = NO_ROOT,
                label: str = "") -> Op:
        head = (DATA, job, dtype_code, opcode, reduce_op.code if reduce_op else 0, root, group)
        return _new(cls, (name, algorithm, opcode, dtype, dtype_code, numel, job, group, label or f"group {group}",
                          reduce_op, root, timeout, ranks, rank, head, seq, key, time.monotonic() + timeout))

    def again(self, seq: int, key: Hashable | None) -> Op:
        return _new(Op, (*self[:_PER_CALL], seq, key, time.monotonic() + self.timeout))


_new = tuple.__new__
_PER_CALL = _OpFields._fields.index("seq")  # fields from 'seq' on change with every call
_Pending = tuple[Request, Msg, "np.ndarray | None"]


def run(program: Program, buffers: Mapping[str, np.ndarray], transport: Transport, op: Op,
        scratch_for: ScratchFor | None = None, codecs: Codecs = _NO_CODECS) -> None:
    """Execute ``program``; raise a CollectiveError naming this rank, the op and the peer on failure.

    ``scratch_for(count, dtype, slot)`` lends the memory reducing receives land in (slots 0 and 1, used by
    alternate steps). The next step's receives are posted before this step's sends whenever the plan says
    that is safe, or else once this step's sends are done where only they were in the way, so a fast
    neighbour's data lands in place instead of being buffered.
    """
    try:
        _run(program, buffers, transport, op, scratch_for, codecs)
    except ErdmaError:
        raise  # aborted where it was raised
    except Exception as exc:  # a fault on this rank: its peers must not wait for it until their timeout
        transport.abort(AbortedError(f"rank {op.rank}: {op.name} ({op.label}, seq {op.seq}) failed there: "
                                     f"{type(exc).__name__}: {exc}", rank=op.rank, op=op.name))
        raise


def _run(program: Program, buffers: Mapping[str, np.ndarray], transport: Transport, op: Op,
         scratch_for: ScratchFor | None, codecs: Codecs) -> None:
    fwd = Forwarding() if codecs.lossy else None
    raw = codecs.sender is None
    # sends a step keeps under way at once: one (the next is posted once the last is written), or over a
    # pool of connections (``Transport.stripes``) one per connection, so that each has data to carry; an
    # encoded message's bytes may be a codec's reused memory, so those still go one at a time
    window = transport.stripes if raw else 1
    stages = program.stages
    last = len(stages) - 1
    seq, deadline, numel = op.seq, op.deadline, op.numel
    head = op.head
    posted: list[_Pending] | None = None
    for i, st in enumerate(stages):
        for c in st.copies:
            buffers[c.dst][c.dst_offset:c.dst_offset + c.count] = buffers[c.src][c.src_offset:c.src_offset + c.count]
            if fwd is not None:
                fwd.copied(c.src, c.src_offset, c.dst, c.dst_offset, c.count)
        exchanged: list[tuple[int, str, int, int]] = []
        if fwd is not None and st.sends_copied:
            exchanged = _encode_copies(st, i, buffers, op, codecs, fwd)
        pending = posted if posted is not None else _post(st, i & 1, buffers, transport, op, head, scratch_for)
        posted = None
        if i < last and stages[i + 1].early:
            posted = _post(stages[i + 1], (i + 1) & 1, buffers, transport, op, head, scratch_for)
        done = 0
        sends = st.sends
        # compression.pipeline: message k + 1 encodes on the helper thread while message k is sent (see _prepare)
        ahead = not raw and codecs.pipeline and len(sends) > 1
        got = _prepare(codecs, fwd, op, i, sends[0], buffers) if ahead else None
        sending: deque[tuple[Request, int]] = deque()  # sends under way: a pool takes ``window`` at once
        try:
            for k, m in enumerate(sends):
                if raw:
                    payload = as_bytes(buffers[m.buf][m.offset:m.offset + m.count])
                    header = make_header((*head, m.tag, seq, RAW, 0, numel, m.count, m.nbytes))
                else:
                    codec, meta, payload = (_collect(got, fwd, op, m, transport) if ahead
                                            else _outgoing(codecs, fwd, op, i, m, buffers[m.buf]))
                    if ahead and k + 1 < len(sends):
                        got = _prepare(codecs, fwd, op, i, sends[k + 1], buffers)
                    header = make_header((*head, m.tag, seq, codec, meta, numel, m.count, len(payload)))
                req = transport.isend(m.to, header, payload, deadline)
                if not req.finished or req.error is not None:
                    sending.append((req, m.peer))
                    while sending and (len(sending) >= window or sending[0][0].finished):
                        finish(*sending.popleft(), op, transport, "sending to")
                while done < len(pending) and pending[done][0].finished:
                    _land(pending[done], buffers, op, transport, codecs, fwd, exchanged)
                    done += 1
            while sending:
                finish(*sending.popleft(), op, transport, "sending to")
        except BaseException:
            if ahead:
                _abandon(got, op)
            raise
        if i < last and stages[i + 1].after_sends:  # what the sends read is free: post before peers send
            posted = _post(stages[i + 1], (i + 1) & 1, buffers, transport, op, head, scratch_for)
        for item in pending[done:]:
            _land(item, buffers, op, transport, codecs, fwd, exchanged)


class _Job(NamedTuple):
    """A message to encode afresh: the elements, where error feedback keeps its residual, and where they lie."""

    view: np.ndarray
    site: Site | None
    buf: str
    lo: int
    hi: int


class _Running(NamedTuple):
    """A ``_Job`` encoding on the codecs' helper thread (``Codecs.ahead``)."""

    job: _Job
    future: Future[Outgoing | None]


def _outgoing(codecs: Codecs, fwd: Forwarding | None, op: Op, step: int, m: Msg, arr: np.ndarray) -> Outgoing:
    """What goes on the wire for message ``m`` of ``arr``: raw, forwarded as it came, or encoded afresh."""
    got = _choose(codecs, fwd, op, step, m, arr)
    if type(got) is _Job:
        return _settle(fwd, got, _encode(codecs, op.dtype, got, fwd is not None))
    return got  # type: ignore[return-value]


def _choose(codecs: Codecs, fwd: Forwarding | None, op: Op, step: int, m: Msg, arr: np.ndarray) -> Outgoing | _Job:
    """``_outgoing``'s decision, without the encoding: an Outgoing (raw, or forwarded as it came) or a _Job."""
    buf, off, cnt = m.buf, m.offset, m.count
    view = arr[off:off + cnt]
    if codecs.sender is None or view.nbytes < codecs.min_bytes or not codecs.worth(m.to, view.nbytes):
        if codecs.sender is not None:
            codecs.counted("small" if view.nbytes < codecs.min_bytes else "skipped", view.nbytes)
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
    return _Job(view, site, buf, off, off + cnt)


def _encode(codecs: Codecs, dtype: str, job: _Job, keep: bool) -> Outgoing | None:
    """Encode ``job``; ``keep`` (a lossy compressor's Forwarding): the elements become what peers decode.
    Touches only the job's elements, so it may run on the helper thread."""
    out = codecs.encode(job.view, dtype, job.site)
    if out is not None and keep and job.buf != "in":
        codecs.decode_own(out, dtype, job.view)  # this rank keeps what its peers will see
    return out


def _settle(fwd: Forwarding | None, job: _Job, out: Outgoing | None) -> Outgoing:
    """What goes on the wire for an encoded ``job`` (raw if the codec declined), recorded for forwarding."""
    if fwd is not None and job.buf != "in":
        fwd.record(job.buf, job.lo, job.hi, out)
    return out if out is not None else (RAW, 0, as_bytes(job.view))


def _prepare(codecs: Codecs, fwd: Forwarding | None, op: Op, step: int, m: Msg,
             buffers: Mapping[str, np.ndarray]) -> Outgoing | _Running:
    """Message ``m``'s Outgoing, or its encoding started on the helper thread. Deciding before the previous
    message is sent is safe: a step's receives never land where a later send of the step reads (``program``),
    and the decisions (encode, forward as it came, or raw) are still taken here, in message order."""
    got = _choose(codecs, fwd, op, step, m, buffers[m.buf])
    if type(got) is _Job:
        return _Running(got, codecs.ahead(_encode, codecs, op.dtype, got, fwd is not None))
    return got  # type: ignore[return-value]


def _abandon(got: Outgoing | _Running | None, op: Op) -> None:
    """A step failed while an encoding ran ahead: it writes into the buffer, so let it end first (bounded)."""
    if type(got) is _Running and not got.future.cancel():
        with contextlib.suppress(BaseException):
            got.future.exception(timeout=max(0.0, op.deadline - time.monotonic()))


def _collect(got: Outgoing | _Running, fwd: Forwarding | None, op: Op, m: Msg, transport: Transport) -> Outgoing:
    """``_prepare``'s result, once its encoding is done (within the op's deadline)."""
    if type(got) is not _Running:
        return got  # type: ignore[return-value]
    try:
        out = got.future.result(timeout=max(0.0, op.deadline - time.monotonic()))
    except FutureTimeout:
        err = CollectiveTimeoutError(
            f"rank {op.rank}: {op.name} ({op.label}, seq {op.seq}) hit its timeout of {op.timeout:.1f}s "
            f"encoding a message for rank {op.ranks[m.peer]}", rank=op.rank, op=op.name)
        transport.abort(err)
        raise err from None
    return _settle(fwd, got.job, out)


def _encode_copies(st: Stage, i: int, buffers: Mapping[str, np.ndarray], op: Op, codecs: Codecs,
                   fwd: Forwarding) -> list[tuple[int, str, int, int]]:
    """Lossy compressor: a step that sends a copy (``Copy('out', ..., 'work', ...)``, then send 'work') encodes
    it now, before any receive of the step lands, and the copy's source takes the decoded values too. A rank
    that sends its elements and also reduces into them (recursive doubling) then combines the same values its
    peer received; the sends below forward these bytes. Returns the source ranges so exchanged, with the
    peer: ``(peer, buffer, start, end)``."""
    exchanged = []
    for m in st.sends:
        off, cnt = m.offset, m.count
        for c in st.copies:
            if c.dst != m.buf or c.src == "in" or not (c.dst_offset <= off and off + cnt <= c.dst_offset + c.count):
                continue
            src = c.src_offset + off - c.dst_offset
            exchanged.append((m.peer, c.src, src, src + cnt))
            if fwd.lookup(m.buf, off, off + cnt) is OWN:
                out = _outgoing(codecs, fwd, op, i, m, buffers[m.buf])
                buffers[c.src][src:src + cnt] = buffers[m.buf][off:off + cnt]
                fwd.record(c.src, src, src + cnt, out if out[0] != RAW else None)
    return exchanged


def _post(st: Stage, slot: int, buffers: Mapping[str, np.ndarray], transport: Transport, op: Op,
          head: tuple[int, ...], scratch_for: ScratchFor | None) -> list[_Pending]:
    if not st.recvs:
        return []
    out = buffers["out"]
    if st.scratch:
        scratch = scratch_for(st.scratch, out.dtype, slot) if scratch_for else np.empty(st.scratch, out.dtype)
    else:
        scratch = out[:0]  # reducing receives of no elements land in nothing
    seq, numel = op.seq, op.numel
    pending = []
    for m in st.recvs:
        if m.reduce:
            land = scratch[m.scratch:m.scratch + m.count]
        else:
            land = buffers[m.buf][m.offset:m.offset + m.count]
        req = transport.irecv(m.to, make_header((*head, m.tag, seq, RAW, 0, numel, m.count, m.nbytes)),
                              as_bytes(land))
        pending.append((req, m, land if m.reduce else None))
    return pending


def _land(item: _Pending, buffers: Mapping[str, np.ndarray], op: Op, transport: Transport, codecs: Codecs,
          fwd: Forwarding | None, exchanged: Sequence[tuple[int, str, int, int]] = ()) -> None:
    req, m, scratch = item
    if not req.finished or req.error is not None:
        finish(req, m.peer, op, transport, "waiting for")
    off, cnt = m.offset, m.count
    if req.encoded is not None:
        header, payload = req.encoded
        decode(codecs, header, payload, scratch if scratch is not None else buffers[m.buf][off:off + cnt], op,
               transport, m.peer)
        if fwd is not None and scratch is None:
            fwd.record(m.buf, off, off + cnt, (header.codec, header.meta, payload))
    elif fwd is not None and scratch is None:
        fwd.record(m.buf, off, off + cnt, None)
    if scratch is not None:
        assert op.reduce_op is not None
        reduce_ops.reduce_into(buffers[m.buf][off:off + cnt], scratch, op.reduce_op, op.dtype)
        if fwd is not None:
            # the elements are this rank's own now, unless it exchanged them with this peer in this step: then
            # the peer holds the same sum, and a later send of it must go raw (an encoder's state differs
            # from rank to rank, so two ranks encoding the same values need not agree)
            same = any(p == m.peer and b == m.buf and lo <= off and off + cnt <= hi for p, b, lo, hi in exchanged)
            if same:
                fwd.record(m.buf, off, off + cnt, None)
            else:
                fwd.forget(m.buf, off, off + cnt)


def decode(codecs: Codecs, header: Header, payload: memoryview, out: np.ndarray, op: Op, transport: Transport,
           peer: int) -> None:
    """Decode a message from group rank ``peer``; a payload that cannot be decoded fails the job."""
    try:
        codecs.decode(header, payload, op.dtype, out, op.rank, op.ranks[peer])
    except ProtocolError as exc:
        err = ProtocolError(f"{op.name} ({op.label}, seq {op.seq}) failed on rank {op.rank}: {exc}")
        transport.abort(err)
        raise err from exc


def finish(req: Request, peer: int, op: Op, transport: Transport, doing: str) -> None:
    who = op.ranks[peer]
    waiting = doing == "waiting for" and op.name not in _P2P  # a receive of a collective
    try:
        ok = (req.finished and req.error is None) or transport.wait(req, op.deadline)
        # a rank that sent part of this collective called it and waits on another (or hangs): the wait on it
        # goes on for a grace period, so that the rank waiting on the one that never called the collective
        # times out first and its ABORT, which names that rank, reaches everyone
        heard = not ok and waiting and transport.heard(who, op.group, op.seq)
        if heard:
            ok = transport.wait(req, time.monotonic() + _grace(op.timeout))
    except CollectiveError as exc:
        transport.abort(exc)
        raise type(exc)(f"{op.name} ({op.label}, seq {op.seq}) failed on rank {op.rank}: {exc}",
                        **_fields(exc, op)) from None  # (the message carries exc's)
    except ErdmaError as exc:  # a peer broke the protocol, or this rank could not send
        transport.abort(exc)
        raise
    if not ok:
        why = ""
        if heard:
            why = ", which called it and sent part of it, then stopped (it waits on another rank, or hangs)"
        elif waiting:
            why = f", which sent nothing of it: rank {who} has not called it (or waits on another rank first)"
        err = CollectiveTimeoutError(
            f"rank {op.rank}: {op.name} ({op.label}, seq {op.seq}) hit its timeout of {op.timeout:.1f}s "
            f"{doing} rank {who}{why}", rank=op.rank, op=op.name)
        transport.abort(err)
        raise err


_P2P = ("send", "recv")


def _grace(timeout: float) -> float:
    """Seconds a timed-out wait on a rank that called the collective goes on: a tenth of the timeout, within
    1-10 s (ranks enter a collective at different times)."""
    return min(10.0, max(1.0, timeout / 10))


def _fields(exc: CollectiveError, op: Op) -> dict[str, object]:
    fields: dict[str, object] = {"rank": op.rank, "op": op.name}
    if hasattr(exc, "peer"):
        fields["peer"] = exc.peer
    return fields
