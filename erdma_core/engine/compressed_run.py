"""``Coded``: one run's compression side. The executor calls it once per step (``step``), once per outgoing
message (``outgoing``: raw, forwarded as it came, or encoded, on the codecs' helper thread one message ahead
with ``compression.pipeline``) and once per landed message (``landed``: decoded, reduced, and, for a lossy
compressor, recorded in the run's ``Forwarding`` so that every rank ends with elements from one encoding).
A run without a compressor to send with has none: the executor sends raw and only decodes what comes encoded.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import NamedTuple

import numpy as np

from ..compression import Site
from ..errors import CollectiveTimeoutError, ProtocolError
from ..protocol import reduce_ops
from ..transport.base import Transport
from ..transport.mailbox import as_bytes
from ..transport.request import Request
from ..wire import RAW, Header
from .codec_set import MIXED, OWN, Codecs, Forwarding, Outgoing
from .op import Op
from .program import Msg, Stage


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


class Coded:
    """The compression side of one run of ``op`` on ``buffers`` with ``codecs`` (whose ``sender`` is set)."""

    def __init__(self, codecs: Codecs, op: Op, buffers: Mapping[str, np.ndarray], transport: Transport) -> None:
        self._codecs, self._op, self._buffers, self._transport = codecs, op, buffers, transport
        self._fwd = Forwarding() if codecs.lossy else None
        self._step = 0
        self._sends: tuple[Msg, ...] = ()
        self._ahead = False
        self._got: Outgoing | _Running | None = None
        self._exchanged: list[tuple[int, str, int, int]] = []  # (peer, buffer, start, end): see _encode_copies

    def step(self, i: int, st: Stage) -> None:
        """Step ``i`` begins; its copies are made."""
        fwd = self._fwd
        self._step, self._sends = i, st.sends
        self._exchanged = []
        if fwd is not None:
            for c in st.copies:
                fwd.copied(c.src, c.src_offset, c.dst, c.dst_offset, c.count)
            if st.sends_copied:
                self._exchanged = self._encode_copies(st)
        # compression.pipeline: message k + 1 encodes on the helper thread while message k is sent (``_prepare``)
        self._ahead = self._codecs.pipeline and len(st.sends) > 1
        self._got = None

    def outgoing(self, k: int) -> Outgoing:
        """What goes on the wire for the step's message ``k`` (called in message order, once the step's
        receives are posted)."""
        m = self._sends[k]
        if not self._ahead:
            return self._outgoing(m)
        out = self._collect(self._prepare(m) if k == 0 else self._got, m)  # type: ignore[arg-type]
        if k + 1 < len(self._sends):
            self._got = self._prepare(self._sends[k + 1])
        return out

    def abandon(self) -> None:
        """The step failed while an encoding ran ahead: it writes into the buffer, so let it end first (bounded)."""
        got = self._got
        if self._ahead and type(got) is _Running and not got.future.cancel():
            with contextlib.suppress(BaseException):
                got.future.exception(timeout=max(0.0, self._op.deadline - time.monotonic()))

    def landed(self, req: Request, m: Msg, scratch: np.ndarray | None) -> None:
        """A receive of the step completed: decode it where it landed, reduce a reducing one, record both."""
        op, fwd, buffers = self._op, self._fwd, self._buffers
        off, cnt = m.offset, m.count
        if req.encoded is not None:
            header, payload = req.encoded
            decode(self._codecs, header, payload, scratch if scratch is not None else
                        buffers[m.buf][off:off + cnt], op, self._transport, m.peer)
            if fwd is not None and scratch is None:
                fwd.record(m.buf, off, off + cnt, (header.codec, header.meta, payload))
        elif fwd is not None and scratch is None:
            fwd.record(m.buf, off, off + cnt, None)
        if scratch is None:
            return
        assert op.reduce_op is not None
        reduce_ops.reduce_into(buffers[m.buf][off:off + cnt], scratch, op.reduce_op, op.dtype)
        if fwd is not None:
            # the elements are this rank's own now, unless it exchanged them with this peer in this step: then
            # the peer holds the same sum, and a later send of it must go raw (an encoder's state differs
            # from rank to rank, so two ranks encoding the same values need not agree)
            same = any(p == m.peer and b == m.buf and lo <= off and off + cnt <= hi
                       for p, b, lo, hi in self._exchanged)
            if same:
                fwd.record(m.buf, off, off + cnt, None)
            else:
                fwd.forget(m.buf, off, off + cnt)

    # ---- outgoing messages ----------------------------------------------------------------------------
    def _outgoing(self, m: Msg) -> Outgoing:
        """What goes on the wire for message ``m``: raw, forwarded as it came, or encoded afresh."""
        got = self._choose(m)
        if type(got) is _Job:
            return self._settle(got, self._encode(got))
        return got  # type: ignore[return-value]

    def _choose(self, m: Msg) -> Outgoing | _Job:
        """``_outgoing``'s decision, without the encoding: an Outgoing (raw, or forwarded as it came) or a _Job."""
        codecs, fwd, op = self._codecs, self._fwd, self._op
        buf, off, cnt = m.buf, m.offset, m.count
        view = self._buffers[buf][off:off + cnt]
        if codecs.sends_raw(m.to, view.nbytes):
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
        site = Site(op.key, op.name, op.algorithm, self._step, off, cnt) if op.key is not None else None
        return _Job(view, site, buf, off, off + cnt)

    def _encode(self, job: _Job) -> Outgoing | None:
        """Encode ``job``; with a lossy compressor's Forwarding the elements become what peers decode.
        Touches only the job's elements, so it may run on the helper thread."""
        codecs, dtype = self._codecs, self._op.dtype
        out = codecs.encode(job.view, dtype, job.site)
        if out is not None and self._fwd is not None and job.buf != "in":
            codecs.decode_own(out, dtype, job.view)  # this rank keeps what its peers will see
        return out

    def _settle(self, job: _Job, out: Outgoing | None) -> Outgoing:
        """What goes on the wire for an encoded ``job`` (raw if the codec declined), recorded for forwarding."""
        if self._fwd is not None and job.buf != "in":
            self._fwd.record(job.buf, job.lo, job.hi, out)
        return out if out is not None else (RAW, 0, as_bytes(job.view))

    def _prepare(self, m: Msg) -> Outgoing | _Running:
        """Message ``m``'s Outgoing, or its encoding started on the helper thread. Deciding before the previous
        message is sent is safe: a step's receives never land where a later send of the step reads (``program``),
        and the decisions (encode, forward as it came, or raw) are still taken here, in message order."""
        got = self._choose(m)
        if type(got) is _Job:
            return _Running(got, self._codecs.ahead(self._encode, got))
        return got  # type: ignore[return-value]

    def _collect(self, got: Outgoing | _Running, m: Msg) -> Outgoing:
        """``_prepare``'s result, once its encoding is done (within the op's deadline)."""
        if type(got) is not _Running:
            return got  # type: ignore[return-value]
        op = self._op
        try:
            out = got.future.result(timeout=max(0.0, op.deadline - time.monotonic()))
        except FutureTimeout:
            err = CollectiveTimeoutError(
                f"rank {op.rank}: {op.name} ({op.label}, seq {op.seq}) hit its timeout of {op.timeout:.1f}s "
                f"encoding a message for rank {op.ranks[m.peer]}", rank=op.rank, op=op.name)
            self._transport.abort(err)
            raise err from None
        return self._settle(got.job, out)

    def _encode_copies(self, st: Stage) -> list[tuple[int, str, int, int]]:
        """Lossy compressor: a step that sends a copy (``Copy('out', ..., 'work', ...)``, then send 'work')
        encodes it now, before any receive of the step lands, and the copy's source takes the decoded values
        too. A rank that sends its elements and also reduces into them (recursive doubling) then combines the
        same values its peer received; the sends below forward these bytes. Returns the source ranges so
        exchanged, with the peer: ``(peer, buffer, start, end)``."""
        fwd, buffers = self._fwd, self._buffers
        assert fwd is not None
        exchanged = []
        for m in st.sends:
            off, cnt = m.offset, m.count
            for c in st.copies:
                if c.dst != m.buf or c.src == "in" or not (c.dst_offset <= off and off + cnt <= c.dst_offset + c.count):
                    continue
                src = c.src_offset + off - c.dst_offset
                exchanged.append((m.peer, c.src, src, src + cnt))
                if fwd.lookup(m.buf, off, off + cnt) is OWN:
                    out = self._outgoing(m)
                    buffers[c.src][src:src + cnt] = buffers[m.buf][off:off + cnt]
                    fwd.record(c.src, src, src + cnt, out if out[0] != RAW else None)
        return exchanged


def decode(codecs: Codecs, header: Header, payload: memoryview, out: np.ndarray, op: Op, transport: Transport,
           peer: int) -> None:
    """Decode a message from group rank ``peer``; a payload that cannot be decoded fails the job."""
    try:
        codecs.decode(header, payload, op.dtype, out, op.rank, op.ranks[peer])
    except ProtocolError as exc:
        err = ProtocolError(f"{op.name} ({op.label}, seq {op.seq}) failed on rank {op.rank}: {exc}")
        transport.abort(err)
        raise err from exc
