"""Runs a rank's program (its plan compiled for the group and the size, ``program.py``) on a transport: the
only place where algorithms meet the network.

Per step: local copies, then every receive is posted (reducing receives land in scratch memory), then the
sends go out chunk by chunk; between chunks, receives that have landed are reduced in schedule order, so
reduction overlaps the transfer. Messages larger than the chunk size were split when the program was
compiled; both sides split the same way, so chunk k of a slice meets chunk k. With a compressor
(``codec_set``), a chunk of at least ``min_bytes`` leaves encoded and is decoded where it lands, before any
reduction.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

import numpy as np

from ..errors import AbortedError, CollectiveError, CollectiveTimeoutError, ErdmaError
from ..protocol import reduce_ops
from ..transport.base import Transport
from ..transport.mailbox import as_bytes
from ..transport.request import Request
from ..wire import RAW, make_header
from .codec_set import NO_CODECS, Codecs
from .compressed_run import Coded, decode
from .op import Op
from .program import Msg, Program, Stage

ScratchFor = Callable[[int, np.dtype, int], np.ndarray]


_Pending = tuple[Request, Msg, "np.ndarray | None"]


def run(program: Program, buffers: Mapping[str, np.ndarray], transport: Transport, op: Op,
        scratch_for: ScratchFor | None = None, codecs: Codecs = NO_CODECS) -> None:
    """Execute ``program``; raise a CollectiveError naming this rank, the op and the peer on failure. A
    transport that runs the whole program on a path of its own (``Transport.run_program``) is asked first.

    ``scratch_for(count, dtype, slot)`` lends the memory reducing receives land in (slots 0 and 1, used by
    alternate steps). The next step's receives are posted before this step's sends whenever the plan says
    that is safe, or else once this step's sends are done where only they were in the way, so a fast
    neighbour's data lands in place instead of being buffered.
    """
    whole = getattr(transport, "run_program", None)  # (a transport plugin on the bare protocol may lack it)
    if codecs.sender is None and whole is not None and whole(program, buffers, op):
        return
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
    coded = Coded(codecs, op, buffers, transport) if codecs.sender is not None else None
    # sends a step keeps under way at once: one (the next is posted once the last is written), or over a
    # pool of connections (``Transport.stripes``) one per connection, so that each has data to carry; an
    # encoded message's bytes may be a codec's reused memory, so those still go one at a time
    window = transport.stripes if coded is None else 1
    stages = program.stages
    last = len(stages) - 1
    seq, deadline, numel = op.seq, op.deadline, op.numel
    head = op.head
    posted: list[_Pending] | None = None
    for i, st in enumerate(stages):
        for c in st.copies:
            buffers[c.dst][c.dst_offset:c.dst_offset + c.count] = buffers[c.src][c.src_offset:c.src_offset + c.count]
        if coded is not None:
            coded.step(i, st)
        pending = posted if posted is not None else _post(st, i & 1, buffers, transport, op, head, scratch_for)
        posted = None
        if i < last and stages[i + 1].early:
            posted = _post(stages[i + 1], (i + 1) & 1, buffers, transport, op, head, scratch_for)
        done = 0
        sending: deque[tuple[Request, int]] = deque()  # sends under way: a pool takes ``window`` at once
        try:
            for k, m in enumerate(st.sends):
                if coded is None:
                    payload = as_bytes(buffers[m.buf][m.offset:m.offset + m.count])
                    header = make_header((*head, m.tag, seq, RAW, 0, numel, m.count, m.nbytes))
                else:
                    codec, meta, payload = coded.outgoing(k)
                    header = make_header((*head, m.tag, seq, codec, meta, numel, m.count, len(payload)))
                req = transport.isend(m.to, header, payload, deadline)
                if not req.finished or req.error is not None:
                    sending.append((req, m.peer))
                    while sending and (len(sending) >= window or sending[0][0].finished):
                        finish(*sending.popleft(), op, transport, "sending to")
                while done < len(pending) and pending[done][0].finished:
                    _land(pending[done], buffers, op, transport, codecs, coded)
                    done += 1
            while sending:
                finish(*sending.popleft(), op, transport, "sending to")
        except BaseException:
            if coded is not None:
                coded.abandon()
            raise
        if i < last and stages[i + 1].after_sends:  # what the sends read is free: post before peers send
            posted = _post(stages[i + 1], (i + 1) & 1, buffers, transport, op, head, scratch_for)
        for item in pending[done:]:
            _land(item, buffers, op, transport, codecs, coded)


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
          coded: Coded | None) -> None:
    req, m, scratch = item
    if not req.finished or req.error is not None:
        finish(req, m.peer, op, transport, "waiting for")
    if coded is not None:
        coded.landed(req, m, scratch)
        return
    off, cnt = m.offset, m.count
    if req.encoded is not None:  # a peer that compresses: decoded here, whatever this rank sends with
        decode(codecs, *req.encoded, scratch if scratch is not None else buffers[m.buf][off:off + cnt], op,
               transport, m.peer)
    if scratch is not None:
        assert op.reduce_op is not None
        reduce_ops.reduce_into(buffers[m.buf][off:off + cnt], scratch, op.reduce_op, op.dtype)


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
        raise op.failed(exc) from None  # (the message carries exc's)
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

