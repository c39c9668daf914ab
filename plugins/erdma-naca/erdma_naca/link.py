"""A rank's link to one aggregation node: JOIN (with the node's cookie: ``header``), the chunks of one
collective with selective retransmission (R6), LEAVE. Runs on the thread that runs the collective; waits in
``recv`` with a timeout (no polling). Every datagram it sends carries the next value of the link's counter,
which the node takes once; the node's answers are tagged with the job's key bound to that node.

Congestion control as TCP Reno's, counted in chunks, telling congestion from noise by delay: the window
starts at 10, grows by one per answer up to ``ssthresh`` and by one per window after, and never exceeds the
``window`` the caller allows (the node's slots and ``inflight_bytes``). While the last round trip is half
again the shortest one (a queue is building) it stops growing, and a loss (found by later answers, or a
timeout) halves it, once per round trip; a loss without a queue is taken for a lossy link and only
retransmitted (plain Reno ran a 16 MiB allreduce in 14 s on the lab's continental link, this in 6.6 s).
A chunk the node has answered PENDING for is waiting for other ranks, not lost.

Chunks go out in order, at most ``window`` unanswered, and chunk ``i`` only once chunk ``i - window`` is
answered (they share a slot on the node). Each unanswered chunk has its own timer: SRTT + 4 RTTVAR (RFC 6298;
Karn: only first transmissions are timed), at least ``rto_min``, doubling per retry up to ``rto_max``, which
is also the first timer before any RTT was measured, and never more than a quarter of ``node_timeout`` (so
that silence is judged after at least three tries, not one lost datagram); only that chunk is sent again,
flagged RETRY; and a chunk still unanswered when three chunks sent after it have been answered is sent
again at once (the ranks send in the same order, so the node completes chunks nearly in order). The node
answers a retried chunk still waiting for other ranks with PENDING, so a rank can tell a slow peer (keep
waiting, probing every ``node_timeout / 4``) from a dead node (nothing at all for ``node_timeout``, judged
only after the socket was read dry, so that a rank that was not scheduled for a while does not take answers
waiting in its buffer for silence: ``NodeGone``).
"""

from __future__ import annotations

import heapq
import random
import socket
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from . import header as H


class NodeGone(Exception):
    """The node did not answer (unreachable, dead, or it forgot the job)."""


class NodeRefused(Exception):
    """The node refused the job (REJECT): ``reason`` is a ``header.REASONS`` code."""

    def __init__(self, reason: int, text: str) -> None:
        super().__init__(text)
        self.reason = reason


class NodeError(Exception):
    """The node reported the ranks' contributions inconsistent (ERROR): a mismatch, not a failure."""


class Chunk(NamedTuple):
    offset: int  # elements
    count: int
    payload: memoryview | None  # None: a contribution without data (broadcast's non-roots)
    result: bool  # the answer carries elements (RESULT), else DONE


class Counters:
    def __init__(self) -> None:
        self.datagrams_sent = self.datagrams_received = self.bytes_sent = self.bytes_received = 0
        self.retransmissions = 0


class Link:
    def __init__(self, address: tuple[str, int], *, job: int, group: int, rank: int, size: int, key: bytes,
                 admission: bytes, node_timeout: float, rto_min: float, rto_max: float, loss: float = 0.0) -> None:
        self.address = address
        self.job, self.group, self.rank, self.size = job, group, rank, size
        self.key, self.admission = key, admission
        self.node_timeout, self.rto_min, self.rto_max = node_timeout, rto_min, rto_max
        self.loss, self._rng = loss, random.Random()
        self.counters = Counters()
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.cwnd, self.ssthresh = 10.0, float("inf")  # chunks in flight (module docstring)
        self.min_rtt, self.last_rtt = float("inf"), 0.0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.sock.connect(address)  # also filters: only the node's datagrams arrive
        self.granted = 0
        self.counter = 0  # the last counter sent: every datagram takes the next
        self.node_key = b""  # the job's key bound to the node, once it has answered a JOIN

    def close(self) -> None:
        self.sock.close()

    # ---- datagrams ------------------------------------------------------------------------------------
    def _send(self, h: H.Header, payload: bytes | memoryview, key: bytes) -> None:
        """``h`` with the next counter, tagged with ``key``."""
        self.counter += 1
        data = H.pack(h._replace(counter=self.counter), payload, key)
        self.counters.datagrams_sent += 1
        self.counters.bytes_sent += len(data)
        if self.loss and self._rng.random() < self.loss:
            return
        try:
            self.sock.send(data)
        except (ConnectionRefusedError, BlockingIOError):
            pass  # the node's port is closed (ICMP) or the buffer is full: the timers retry

    def _recv(self, timeout: float) -> bytes | None:
        """The next datagram within ``timeout``; None when there is none (one dropped by ``loss`` is not the
        end: the buffer is read on)."""
        self.sock.settimeout(max(timeout, 0.0))
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except (TimeoutError, BlockingIOError):
                return None
            except ConnectionRefusedError:  # ICMP port unreachable for an earlier send
                return None
            self.counters.datagrams_received += 1
            self.counters.bytes_received += len(data)
            if not (self.loss and self._rng.random() < self.loss):
                return data
            self.sock.settimeout(0.0)

    # ---- join and leave -------------------------------------------------------------------------------
    def join(self, slots: int, timeout: float) -> int:
        """Register the job with the node (or join it); returns the slots it granted the job. The node answers
        the first JOIN with a cookie (CHALLENGE), the JOIN with it with JOIN_OK; only answers that carry this
        JOIN's nonce count."""
        nonce = random.randbytes(H.NONCE)
        masked = H.xor(self.key, H.wrap_mask(self.admission, self.job, self.group, nonce))
        head = H.Header(H.JOIN, job=self.job, group=self.group, status=slots, rank=self.rank, size=self.size)
        cookie = bytes(H.COOKIE)
        end = time.monotonic() + timeout
        resend = 0.0
        while True:
            now = time.monotonic()
            if now >= resend and now < end:
                self._send(head, nonce + masked + cookie, self.admission)
                resend = now + min(0.2, timeout / 4)
            data = self._recv(min(end, resend) - now)
            if data is None:
                if time.monotonic() >= end:  # judged after the buffer was read dry
                    raise NodeGone(f"no answer to JOIN from {_addr(self.address)} in {timeout:.1f}s")
                continue
            try:
                h = H.peek(data)
            except H.Malformed:
                continue
            if h.job != self.job or h.group != self.group or data[H.LAYOUT.size:H.LAYOUT.size + H.NONCE] != nonce:
                continue  # not an answer to this JOIN (another's, or a REJECT of earlier DATA)
            if h.kind == H.REJECT:
                self._rejected(h, data)
            elif h.kind == H.CHALLENGE and h.length == H.NONCE + H.COOKIE and _tag_ok(data, self.admission):
                cookie = bytes(H.verify(data, self.admission)[H.NONCE:])
                resend = 0.0  # at once, with the cookie
            elif h.kind == H.JOIN_OK and h.length == H.NONCE + H.NODE_ID and _tag_ok(data, self.key):
                if h.status < 1:
                    raise NodeRefused(H.NO_SLOTS, "JOIN_OK granting no slots")
                self.node_key = H.node_key(self.key, bytes(H.verify(data, self.key)[H.NONCE:]))
                self.granted = h.status
                return h.status

    def _rejected(self, h: H.Header, data: bytes) -> None:
        """A REJECT of this rank's JOIN: raise if it is authentic (or an unauthenticated 'bad admission'
        hint), else ignore."""
        for key, trusted in ((self.admission, True), (b"", False)):
            if _tag_ok(data, key) and (trusted or h.status == H.BAD_ADMISSION):
                text = H.REASONS.get(h.status, f"reason {h.status}")
                if not trusted:
                    text += " (the node says so; check that the ranks and the node use the same secret file)"
                raise NodeRefused(h.status, f"{_addr(self.address)} refused the job: {text}")

    def leave(self, give_up: bool = False) -> None:
        """Tell the node this rank is done with the job; ``give_up``: it gave the collective under way up (a
        failover), and the node forgets the job so that the other ranks stop waiting there."""
        if self.node_key:
            self._send(H.Header(H.LEAVE, flags=H.GIVE_UP if give_up else 0, job=self.job, group=self.group,
                                rank=self.rank, size=self.size), b"", self.node_key)

    # ---- one collective -------------------------------------------------------------------------------
    def transfer(self, head: H.Header, chunks: Sequence[Chunk], base: int, window: int,
                 land: Callable[[int, memoryview], None], deadline: float) -> None:
        """Send ``chunks`` (chunk i is sequence number ``base + i``) and take every answer; ``land(i, elements)``
        receives each RESULT's payload. ``head`` carries the collective's fields (op, dtype, redop, message,
        total, root). Raises NodeGone, NodeRefused, NodeError or TimeoutError (past ``deadline``)."""
        n = len(chunks)
        done = bytearray(n)
        held = bytearray(n)  # the node said PENDING: it holds this rank's contribution, a timer is a probe
        recover = -1  # the window is cut at most once per round trip: again only for a chunk sent after this
        sent_at = [0.0] * n
        tries = [0] * n
        timers: list[tuple[float, int, int]] = []  # (due, chunk, try): stale entries are skipped
        left = n
        nxt = 0
        inflight = 0
        low = 0  # lowest unanswered chunk
        heard = time.monotonic()
        me = 1 << self.rank
        first = self.counter + 1  # counters this transfer sends start here (the node echoes one in a REJECT)
        while left:
            now = time.monotonic()
            while nxt < n and inflight < min(window, int(self.cwnd)) and (nxt < window or done[nxt - window]):
                self._send_chunk(head, chunks[nxt], base + nxt, me, False)
                sent_at[nxt] = now
                heapq.heappush(timers, (now + self._rto(0), nxt, 0))
                nxt += 1
                inflight += 1
            while timers and (timers[0][0] <= now or done[timers[0][1]] or tries[timers[0][1]] != timers[0][2]):
                _, i, t = heapq.heappop(timers)
                if done[i] or tries[i] != t:
                    continue
                if not held[i] and i > recover and self._queued():  # a timeout, not a probe, with a queue
                    self.ssthresh = self.cwnd = max(2.0, self.cwnd / 2)
                    recover = nxt - 1
                tries[i] = t + 1
                self.counters.retransmissions += 1
                self._send_chunk(head, chunks[i], base + i, me, True)
                sent_at[i] = now
                heapq.heappush(timers, (now + self._rto(t + 1), i, t + 1))
            if now >= deadline:
                raise TimeoutError(f"{left} of {n} chunks unanswered")
            wake = min(timers[0][0] if timers else deadline, deadline, heard + self.node_timeout + 1e-3)
            data = self._recv(wake - now)
            if data is None and time.monotonic() - heard > self.node_timeout:
                raise NodeGone(f"{_addr(self.address)} sent nothing for {time.monotonic() - heard:.1f}s "
                               f"({left} of {n} chunks unanswered)")
            while data is not None:
                got = self._answer(data, head, chunks, base, done, sent_at, tries, land, first)
                if got is not None and got >= 0 and not self._queued():
                    self.cwnd = min(float(window), self.cwnd + (1.0 if self.cwnd < self.ssthresh else 1.0 / self.cwnd))
                if got is not None:
                    heard = time.monotonic()
                    if got <= -2:
                        i = -2 - got
                        held[i] = 1
                        tries[i] += 1
                        heapq.heappush(timers, (heard + self.node_timeout / 4, i, tries[i]))
                    elif got >= 0:
                        left -= 1
                        inflight -= 1
                        # chunks sent before this one and still unanswered 3 answers later: lost, send again
                        for i in range(low, got - 2):
                            if not done[i] and not held[i] and sent_at[i] < sent_at[got]:
                                if i > recover and self._queued():
                                    self.ssthresh = self.cwnd = max(2.0, self.cwnd / 2)
                                    recover = nxt - 1
                                tries[i] += 1
                                self.counters.retransmissions += 1
                                self._send_chunk(head, chunks[i], base + i, me, True)
                                sent_at[i] = heard
                                heapq.heappush(timers, (heard + self._rto(tries[i]), i, tries[i]))
                        while low < n and done[low]:
                            low += 1
                data = self._recv(0.0) if left else None

    def _queued(self) -> bool:
        """The last round trip took half again the shortest one (and 2 ms more): a queue is building."""
        return self.last_rtt > 1.5 * self.min_rtt + 0.002

    def _send_chunk(self, head: H.Header, c: Chunk, seq: int, me: int, retry: bool) -> None:
        h = head._replace(kind=H.DATA, seq=seq, offset=c.offset, count=c.count, bitmap=me, rank=self.rank,
                          size=self.size, flags=(H.NO_DATA if c.payload is None else 0) | (H.RETRY if retry else 0))
        self._send(h, b"" if c.payload is None else c.payload, self.node_key)

    def _rto(self, tries: int) -> float:
        """RFC 6298's timer (SRTT + 4 RTTVAR, ``rto_max`` before the first sample), doubled per retry; at most
        a quarter of ``node_timeout``."""
        base = self.rto_max if self.srtt is None else max(self.rto_min, self.srtt + 4.0 * self.rttvar)
        return min(self.rto_max, self.node_timeout / 4, base * (1 << min(tries, 16)))

    def _answer(self, data: bytes, head: H.Header, chunks: Sequence[Chunk], base: int, done: bytearray,
                sent_at: list[float], tries: list[int], land: Callable[[int, memoryview], None],
                first: int) -> int | None:
        """Take one datagram from the node: the index of the chunk it answered, -1 for a sign of life,
        ``-2 - i`` for PENDING of chunk i, None for one to ignore; raises for ERROR, and for a REJECT of a
        datagram this transfer sent (``first``: its first counter; an older REJECT, or a JOIN's, is stale)."""
        try:
            h = H.peek(data)
        except H.Malformed:
            return None
        if h.job != self.job or h.group != self.group:
            return None
        if h.kind == H.REJECT:
            if h.status == H.UNKNOWN_JOB and first <= h.counter <= self.counter and _tag_ok(data, self.admission):
                raise NodeGone(f"{_addr(self.address)} does not know the job (restarted, or it expired the job)")
            return None
        try:
            payload = H.verify(data, self.node_key)
        except H.Malformed:
            return None
        if h.kind == H.ERROR and h.message == head.message:
            raise NodeError(bytes(payload).decode(errors="replace"))
        i = h.seq - base
        if h.kind == H.PENDING:
            if 0 <= i < len(chunks) and h.message == head.message and not done[i]:
                return -2 - i  # the node holds this rank's contribution: only probe it slowly now
            return -1
        if h.kind not in (H.RESULT, H.DONE) or not 0 <= i < len(chunks) or h.message != head.message:
            return -1 if h.kind in (H.RESULT, H.DONE) else None  # an older chunk's answer again: alive
        c = chunks[i]
        if done[i]:
            return -1
        if h.offset != c.offset or h.count != c.count or (h.kind == H.RESULT) != c.result:
            raise NodeError(f"the node answered chunk {i} with {H.describe(h)}, expected "
                            f"[{c.offset}, +{c.count}) {'RESULT' if c.result else 'DONE'}")
        if c.result:
            land(i, payload)
        done[i] = 1
        if tries[i] == 0:
            rtt = time.monotonic() - sent_at[i]
            self.last_rtt, self.min_rtt = rtt, min(self.min_rtt, rtt)
            if self.srtt is None:
                self.srtt, self.rttvar = rtt, rtt / 2
            else:
                self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
                self.srtt = 0.875 * self.srtt + 0.125 * rtt
        return i


def _tag_ok(data: bytes, key: bytes) -> bool:
    try:
        H.verify(data, key)
    except H.Malformed:
        return False
    return True


def _addr(a: tuple[str, int]) -> str:
    return f"{a[0]}:{a[1]}"
