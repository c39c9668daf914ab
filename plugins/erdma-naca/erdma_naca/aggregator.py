"""The aggregation node's protocol, sans-IO: ``Aggregator.handle(datagram, addr, now)`` returns the datagrams
to send as ``(addr, bytes)``; ``expire(now)`` drops idle jobs. ``serve.py`` is its UDP adapter.

Jobs (R10): a job joins with a JOIN tagged with the node's admission key; it carries the job's own key
(masked), which the node keeps: every later datagram of the job must carry the tag of that key bound to this
node's identity (``header.node_key``), a JOIN for the same job with another key is refused, and datagrams
of jobs the node does not know are answered with REJECT (unknown job) and otherwise ignored. Each job gets
its own slots, at most ``job_slots`` of the pool's ``slots`` (R7: SwitchML/ATP-style bounded slots); no
slots left: REJECT (the ranks fall back, R2). A job silent for ``idle_s`` is forgotten; if it was forgotten
between its ranks' JOINs, the first DATA of a rank it has no JOIN of ends it (as unknown), so that no rank
waits for a contribution that cannot come.

Freshness: a JOIN counts only with a cookie the node gave the JOIN's source address moments before
(CHALLENGE; the node keeps nothing until then), and only then does the rank's address change: results go to
the address of the rank's last JOIN, never to where a datagram came from. Every datagram of a rank carries
a counter the node takes once (``erdma_core.toolkit.integrity.Window``), so a recorded datagram sent
again, from anywhere, is dropped: it neither moves a result nor keeps a job alive. No answer is larger than the authenticated
datagram that caused it, or, for a datagram the node cannot authenticate (a JOIN, DATA of a job it does not
know), than that datagram.

Slots (R4/R5/R6): chunk ``seq`` of a job lives in slot ``seq % granted``. Contributions are kept per rank
and reduced in rank order once every rank's is in, so the result is the same bits as
``((x0 op x1) op x2) ...`` whatever order they arrived in, and a duplicate is never counted twice. The
result goes to every rank that needs it (allreduce: all; reduce_scatter: the slice's owner; broadcast:
the non-roots), DONE to the others. A slot keeps its last result until its next chunk is complete, so a
rank whose result was lost gets it again when it retransmits (a rank sends chunk ``seq + granted`` only
after it has chunk ``seq``'s answer); a retransmitted contribution to a chunk still waiting for others is
answered with PENDING, which tells the rank the node is alive.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field

import numpy as np

from erdma_core.toolkit import dtypes, integrity, reduce_ops

from . import header as H

Addr = tuple[str, int]
Out = list[tuple[Addr, bytes]]


@dataclass
class _Chunk:
    head: H.Header  # the first contribution's header: every other must agree on its fields
    parts: dict[int, bytes] = field(default_factory=dict)  # rank -> payload
    bitmap: int = 0


@dataclass
class _Done:
    seq: int
    result: bytes  # a packed RESULT datagram (empty: none)
    done: bytes  # a packed DONE datagram
    takers: int  # bitmap of the ranks that get ``result``


@dataclass
class _Slot:
    pending: _Chunk | None = None
    last: _Done | None = None


@dataclass
class Job:
    key: bytes  # the job's key (JOINs prove it)
    node_key: bytes  # the job's key bound to this node (every other datagram of the job)
    size: int
    granted: int
    slots: list[_Slot]
    addrs: dict[int, Addr] = field(default_factory=dict)  # where each rank's last fresh JOIN came from
    windows: dict[int, integrity.Window] = field(default_factory=dict)  # the counters taken from each rank
    seen: float = 0.0
    left: int = 0  # bitmap of ranks that sent LEAVE
    joined: dict[int, int] = field(default_factory=dict)  # each rank's counter in its last fresh JOIN


@dataclass
class Stats:
    datagrams: int = 0
    malformed: int = 0
    bad_tag: int = 0
    unknown_job: int = 0
    duplicates: int = 0
    results: int = 0
    joins: int = 0
    rejected_joins: int = 0
    challenges: int = 0
    replays: int = 0  # datagrams whose counter was taken already (or too old), and stale JOINs
    given_up: int = 0  # jobs forgotten because a rank gave its collective up (LEAVE with GIVE_UP)


def _same(a: H.Header, b: H.Header) -> bool:
    return (a.op, a.dtype, a.redop, a.message, a.offset, a.total, a.count, a.root, a.size) == \
        (b.op, b.dtype, b.redop, b.message, b.offset, b.total, b.count, b.root, b.size)


COOKIE_S = 10.0  # a cookie is valid in its 10-second period and the next


class Aggregator:
    def __init__(self, secret: bytes, slots: int, job_slots: int, idle_s: float = 300.0,
                 node_id: bytes | None = None) -> None:
        self.admission = H.admission_key(secret)
        self.node_id = node_id or os.urandom(H.NODE_ID)  # a new one each start: what was meant for another goes
        self._cookies = os.urandom(32)
        self.slots, self.job_slots, self.idle_s = slots, job_slots, idle_s
        self.jobs: dict[tuple[int, int], Job] = {}
        self.stats = Stats()

    @property
    def free(self) -> int:
        return self.slots - sum(j.granted for j in self.jobs.values())

    def handle(self, datagram: bytes, addr: Addr, now: float) -> Out:
        self.stats.datagrams += 1
        try:
            h = H.peek(datagram)
        except H.Malformed:
            self.stats.malformed += 1
            return []
        if h.kind == H.JOIN:
            return self._join(h, datagram, addr, now)
        job = self.jobs.get((h.job, h.group))
        if job is None:
            self.stats.unknown_job += 1
            if h.kind != H.DATA:
                return []
            return [(addr, self._unknown(h))]
        try:
            payload = H.verify(datagram, job.node_key)
        except H.Malformed:
            self.stats.bad_tag += 1
            return []
        if h.size != job.size or h.rank >= job.size:
            self.stats.malformed += 1
            return []
        window = job.windows.get(h.rank)
        if window is None and h.kind == H.DATA:
            return self._forgot(h, addr)
        if window is None or not window.take(h.counter):
            self.stats.replays += 1
            return []
        job.seen = now
        if h.kind == H.LEAVE and h.flags & H.GIVE_UP:
            # a rank fails over: the job goes, and its other ranks learn it at their next datagram; a GIVE_UP
            # older than the rank's last JOIN (sent before the failover's JOINs, overtaken) ends nothing
            if h.counter > job.joined.get(h.rank, h.counter):
                del self.jobs[(h.job, h.group)]
                self.stats.given_up += 1
            return []
        if h.kind == H.LEAVE:
            job.left |= 1 << h.rank
            if job.left == (1 << job.size) - 1:
                del self.jobs[(h.job, h.group)]
            return []
        if h.kind != H.DATA:
            return []
        reply = job.addrs[h.rank]
        problem = self._check(h)
        if problem:
            return [(reply, self._error(h, job, H.MISMATCH, f"rank {h.rank}: {problem}"))]
        return self._data(h, bytes(payload), job, reply)

    def _check(self, h: H.Header) -> str:
        """What is wrong with a DATA header on its own (the other ranks' are compared later)."""
        if h.dtype not in _ITEMSIZE:
            return f"dtype code {h.dtype}"
        if h.count * _ITEMSIZE[h.dtype] > H.MAX_DATAGRAM:
            return f"{h.count} elements exceed the largest chunk ({H.MAX_DATAGRAM} bytes)"
        if h.op == H.BROADCAST:
            if h.root >= h.size:
                return f"root {h.root} of size {h.size}"
            if (h.rank == h.root) == bool(h.flags & H.NO_DATA):
                return "the root sends the data, the other ranks none"
            return ""
        if h.flags & H.NO_DATA or h.redop not in reduce_ops.NAMES:
            return f"a reduction without data or with op code {h.redop}"
        if h.op == H.REDUCE_SCATTER:
            n = h.total // max(1, h.size)
            if h.total % max(1, h.size) or (h.count and h.offset // n != (h.offset + h.count - 1) // n):
                return f"reduce_scatter chunk [{h.offset}, +{h.count}) of {h.total} crosses a rank's slice"
        return ""

    def expire(self, now: float) -> int:
        """Forget jobs that sent nothing for ``idle_s``; returns how many."""
        old = [k for k, j in self.jobs.items() if now - j.seen > self.idle_s]
        for k in old:
            del self.jobs[k]
        return len(old)

    # ---- jobs -----------------------------------------------------------------------------------------
    def _join(self, h: H.Header, datagram: bytes, addr: Addr, now: float) -> Out:
        nonce = datagram[H.LAYOUT.size:len(datagram) - H.TAG_BYTES][:H.NONCE]  # echoed; trusted once the tag is
        try:
            payload = H.verify(datagram, self.admission)
        except H.Malformed:
            self.stats.rejected_joins += 1
            return [(addr, self._reject(h, H.BAD_ADMISSION, b"", nonce))]  # the rank cannot check it: a hint only
        if len(payload) != H.JOIN_PAYLOAD or not 1 <= h.size <= H.MAX_RANKS or h.rank >= h.size or h.status < 1:
            self.stats.rejected_joins += 1
            return [(addr, self._reject(h, H.BAD_JOIN, self.admission, nonce))]
        masked, cookie = bytes(payload[H.NONCE:H.NONCE + 32]), bytes(payload[H.NONCE + 32:])
        period = int(now // COOKIE_S)
        if not any(hmac.compare_digest(cookie, self._cookie(addr, nonce, p)) for p in (period, period - 1)):
            self.stats.challenges += 1
            challenge = H.Header(H.CHALLENGE, job=h.job, group=h.group, rank=H.NO_RANK, size=h.size,
                                 counter=h.counter)
            return [(addr, H.pack(challenge, nonce + self._cookie(addr, nonce, period), self.admission))]
        key = H.xor(masked, H.wrap_mask(self.admission, h.job, h.group, nonce))
        job = self.jobs.get((h.job, h.group))
        if job is not None and (not hmac.compare_digest(job.key, key) or job.size != h.size):
            self.stats.rejected_joins += 1
            return [(addr, self._reject(h, H.JOB_KEY, self.admission, nonce))]
        if job is not None and h.rank in job.windows and h.counter <= job.windows[h.rank].top:
            self.stats.replays += 1  # an older JOIN of this rank again (its counter went on since)
            return []
        if job is None:
            granted = min(h.status, self.job_slots, self.free)
            if granted < 1:
                self.stats.rejected_joins += 1
                return [(addr, self._reject(h, H.NO_SLOTS, self.admission, nonce))]
            job = self.jobs[(h.job, h.group)] = Job(key, H.node_key(key, self.node_id), h.size, granted,
                                                    [_Slot() for _ in range(granted)])
        self.stats.joins += 1
        job.seen = now
        job.addrs[h.rank] = addr
        job.windows[h.rank] = integrity.Window(H.WINDOW, h.counter)
        job.joined[h.rank] = h.counter
        job.left &= ~(1 << h.rank)
        ok = H.Header(H.JOIN_OK, job=h.job, group=h.group, status=job.granted, rank=H.NO_RANK, size=job.size,
                      counter=h.counter)
        return [(addr, H.pack(ok, nonce + self.node_id, key))]

    def _forgot(self, h: H.Header, addr: Addr) -> Out:
        """DATA of a rank this job has no JOIN of: the node forgot the job (idle) after that rank joined and
        another rank's JOIN made it again. Its chunks could never complete, and the ranks that gave theirs
        would wait in PENDING: the job goes, so that this rank's DATA and the others' next (their probes) are
        answered as for a job the node does not know, and they all fail over."""
        self.stats.unknown_job += 1
        del self.jobs[(h.job, h.group)]
        return [(addr, self._unknown(h))]

    def _cookie(self, addr: Addr, nonce: bytes, period: int) -> bytes:
        where = f"{addr[0]}|{addr[1]}|{period}".encode()
        return hmac.digest(self._cookies, where + nonce, "sha256")[:H.COOKIE]

    def _reject(self, h: H.Header, reason: int, key: bytes, nonce: bytes) -> bytes:
        """The REJECT of a JOIN: its nonce, so that the rank takes it for that JOIN only."""
        return H.pack(H.Header(H.REJECT, job=h.job, group=h.group, status=reason, rank=H.NO_RANK, size=h.size,
                               counter=h.counter), nonce, key)

    def _unknown(self, h: H.Header) -> bytes:
        """The REJECT of DATA for a job this node does not know: no payload (no larger than the DATA), the
        DATA's counter, so that the rank takes it only for a datagram it sent."""
        return H.pack(H.Header(H.REJECT, job=h.job, group=h.group, status=H.UNKNOWN_JOB, message=h.message,
                               seq=h.seq, rank=H.NO_RANK, size=h.size, counter=h.counter), b"", self.admission)

    def _error(self, h: H.Header, job: Job, reason: int, detail: str) -> bytes:
        text = f"{H.REASONS[reason]}: {detail}".encode()[:1024]
        return H.pack(h._replace(kind=H.ERROR, status=reason, rank=H.NO_RANK, bitmap=0, flags=0, count=0,
                                 offset=0), text, job.node_key)

    # ---- data -----------------------------------------------------------------------------------------
    def _data(self, h: H.Header, payload: bytes, job: Job, addr: Addr) -> Out:
        """``addr``: where the sender's answers go (its last JOIN's address)."""
        slot = job.slots[h.seq % job.granted]
        last, pend = slot.last, slot.pending
        if last is not None and h.seq == last.seq:  # its answer was lost: again
            self.stats.duplicates += 1
            return [(addr, last.result if last.takers >> h.rank & 1 else last.done)]
        if (last is not None and h.seq < last.seq) or (pend is not None and h.seq < pend.head.seq):
            return []  # stale
        if pend is not None and h.seq > pend.head.seq:
            return []  # a rank cannot be here before the chunk in this slot is complete
        want = 0 if h.flags & H.NO_DATA else h.count * _ITEMSIZE[h.dtype]
        if len(payload) != want:
            return [(addr, self._error(h, job, H.MISMATCH, f"rank {h.rank} sent {len(payload)} bytes for "
                                                         f"{h.count} elements"))]
        if pend is None:
            pend = slot.pending = _Chunk(h)
        elif not _same(pend.head, h):
            err = self._error(h, job, H.MISMATCH, f"rank {h.rank} sent {H.describe(h)} (dtype {h.dtype}, "
                              f"op {h.redop}), another rank {H.describe(pend.head)} (dtype {pend.head.dtype}, "
                              f"op {pend.head.redop})")
            return [(a, err) for a in job.addrs.values()]
        bit = 1 << h.rank
        if pend.bitmap & bit:
            self.stats.duplicates += 1
            pending = pend.head._replace(kind=H.PENDING, rank=H.NO_RANK, bitmap=pend.bitmap, flags=0, count=0,
                                         counter=h.counter)
            return [(addr, H.pack(pending, b"", job.node_key))]
        pend.bitmap |= bit
        if not h.flags & H.NO_DATA:
            pend.parts[h.rank] = payload
        if pend.bitmap != (1 << job.size) - 1:
            return []
        slot.pending = None
        slot.last = done = self._complete(pend, job)
        self.stats.results += 1
        return [(a, done.result if done.takers >> r & 1 else done.done) for r, a in job.addrs.items()]

    def _complete(self, c: _Chunk, job: Job) -> _Done:
        h = c.head
        head = h._replace(rank=H.NO_RANK, bitmap=c.bitmap, flags=0, counter=0)
        if h.op == H.BROADCAST:
            result = c.parts.get(h.root, b"")
            takers = ((1 << job.size) - 1) & ~(1 << h.root)
        else:
            name = dtypes.name_of(h.dtype)
            dt = dtypes.storage(name)
            op = reduce_ops.ReduceOp[reduce_ops.NAMES[h.redop]]
            acc = np.frombuffer(c.parts[0], dt).copy()
            try:
                for r in range(1, job.size):
                    reduce_ops.reduce_into(acc, np.frombuffer(c.parts[r], dt), op, name)
            except TypeError as exc:  # e.g. a bitwise op on floats
                err = self._error(h, job, H.MISMATCH, f"{op.name} on {name}: {exc}")
                return _Done(h.seq, err, err, 0)
            result = acc.tobytes()
            if h.op == H.ALLREDUCE:
                takers = (1 << job.size) - 1
            else:
                takers = 1 << (h.offset // max(1, h.total // job.size))
        done = H.pack(head._replace(kind=H.DONE), b"", job.node_key)
        return _Done(h.seq, H.pack(head._replace(kind=H.RESULT), result, job.node_key), done, takers)


_ITEMSIZE = {dtypes.code_of(n): dtypes.storage(n).itemsize for n in dtypes.NAMES}  # by wire code
