"""The ``verbs`` transport: one reliable-connected queue pair per peer on an RDMA device (``rc``), on the core's
``MessageTransport`` (matching, ABORT, BYE, lost peers), so this module is queue-pair set-up and byte movement.

Set-up, out of band through the job's store: each rank makes a queue pair and a receive ring (``slots``
buffers of ``slot_bytes``, registered for remote writes) per peer, posts its receives, publishes what each
peer needs (QPN, GID, PSN, the ring's address and rkey) under ``verbs/JOB/RANK``, connects every queue pair
to its peer's (INIT -> RTR -> RTS) and waits until every peer says it is ready.

Data: a frame (the core's 64-byte header and its payload) is cut into pieces of at most ``slot_bytes``;
each piece is an RDMA WRITE with immediate (its length) into the peer's next ring slot, several in flight at
once (pipelining). Headers and payloads below ``zero_copy_bytes`` are copied into registered send buffers;
larger payloads go from the caller's own memory, registered once and cached (``regcache``). The receiver
takes each slot's bytes, in order, through the core's ``StreamReader`` (a large payload whose receive is
posted lands straight in the receive's memory), frees the slot and returns credits with a SEND with
immediate (the count of slots freed so far): a sender never writes into a slot the receiver has not freed.
The same SEND, every ``keepalive`` seconds of silence, is how a dead peer is noticed (its queue pair no
longer answers, and after ``retry_count`` retries the send completes in error).

Completions are polled by one I/O thread, sleeping with back-off (up to ``poll_max_us``) and, once idle
that long, on a completion channel until the next completion; or always on the channel (``completion =
"channel"``: no polling at all, a little more latency).
Membership: a queue pair takes packets only from the queue pair it was connected to, whose address came
through the job's store, which every rank proved the job's secret to.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from erdma_core.sdk import (
    AbortedError,
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
    Header,
    MismatchError,
    Op,
    PeerLostError,
    Program,
    ProtocolError,
    Request,
    TransportContext,
)
from erdma_core.toolkit import FRAME, MessageTransport, StreamReader, await_key

from . import native, rc
from .regcache import Region, RegistrationCache

log = logging.getLogger("erdma.verbs")
HEAD = FRAME.size
_RECV = 1 << 62  # wr_id bit of receives (their low bits: the peer)
_MOD = 1 << 31  # credits count modulo this (the immediate's width, less one bit)
_REPOST = 8  # receives posted again at a time
DOZE_S = 0.05  # longest sleep of the idle I/O thread on the completion channel (it sees a close within it)


class _Out:
    """One frame on its way: ``sent`` bytes (header included) posted, ``pending`` writes not completed."""

    __slots__ = ("addr", "head", "payload", "pending", "region", "req", "sent")

    def __init__(self, head: bytes, payload: memoryview, req: Request) -> None:
        self.head, self.payload, self.req = head, payload, req
        self.sent = self.pending = 0
        self.region: Region | None = None
        self.addr = 0


class _Link:
    """One peer: its queue pair, our receive ring for it, our send buffers, its ring's address and credits."""

    def __init__(self, peer: int, qp: Any, ring: np.ndarray, ring_mr: Any, bounce: np.ndarray, bounce_mr: Any,
                 slots: int, bounce_bytes: int) -> None:
        self.peer, self.qp, self.ring, self.ring_mr = peer, qp, ring, ring_mr
        self.ring_view = memoryview(ring)
        self.bounce, self.bounce_mr, self.bounce_bytes = bounce, bounce_mr, bounce_bytes
        self.bounce_addr = bounce.ctypes.data
        self.bounce_view = memoryview(bounce)
        self.free_bounce = list(range(slots))
        self.remote_addr = self.rkey = 0
        self.sent = 0  # writes posted into the peer's ring
        self.peer_freed = 0  # slots the peer says it has freed (mod _MOD)
        self.consumed = 0  # slots of our ring taken
        self.reported = 0  # what our last credit said
        self.queue: deque[_Out] = deque()
        self.posted: deque[tuple[int, _Out | None, int]] = deque()  # send requests not retired, oldest first:
        # (wr_id, the frame whose pieces it carries unless that was copied, our send buffer or -1)
        self.unsignaled = 0  # requests posted since the last signalled one
        self.to_repost = 0  # receives used and not posted again yet
        self.last_send = time.monotonic()
        self.reader: StreamReader | None = None
        self.dead = False
        self.error: BaseException | None = None


def _choose_device(opts: dict[str, Any]) -> str:
    if opts["device"]:
        return str(opts["device"])
    names = rc.device_names()
    if not names:
        raise rc.VerbsError("transport 'verbs': this host has no RDMA device (the kernel has no RDMA support, or "
                            "no device is set up; `erdma doctor` lists what there is). Set transport.verbs.device, "
                            "or choose another transport (tcp, quic)")
    return names[0]


class VerbsTransport(MessageTransport):
    """Factory signature for the registry: ``VerbsTransport(config, section)``."""

    name = "verbs"
    devices = frozenset({"cpu"})

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        super().__init__()
        self.opts = section
        self.slots, self.slot_bytes = section["slots"], section["slot_bytes"]
        self.zero_copy = section["zero_copy_bytes"]
        self.bounce_bytes = HEAD + self.zero_copy
        self.depth = self.slots + 8  # sends: a write per slot, and credits
        self.credit_every = max(1, self.slots // 4)
        self.signal_every = max(1, self.depth // 4)
        self.keepalive = section["keepalive"]
        self.max_pause = section["poll_max_us"] / 1e6
        self.spin = section["spin_us"] / 1e6
        self.channel = section["completion"] == "channel"
        self._waiting = 0  # threads in ``wait``, taking completions themselves
        self.links: dict[int, _Link] = {}
        self.by_qpn: dict[int, _Link] = {}
        self.device: Any = None
        self.cache: RegistrationCache | None = None
        self._lock = threading.RLock()  # the send side: queues, credits, posting
        self._cq_lock = threading.Lock()  # taking completions (the receive side runs under it, in order)
        self._ids = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self.native: native.Native | None = None  # the compiled path (``transport.verbs.native``)
        self._native_lock = threading.Lock()  # one collective on it at a time; close waits for it
        self.native_runs = 0  # collectives the compiled path ran
        self.woken = 0  # sleeps of the idle I/O thread on the completion channel that a completion ended

    # ---- set-up -------------------------------------------------------------------------------------------
    def open(self, ctx: TransportContext) -> None:
        deadline = time.monotonic() + ctx.connect_timeout
        o = self.opts
        self.device = rc.Device(_choose_device(o), o["port"], None if o["gid_index"] < 0 else o["gid_index"],
                                cq_depth=4 * self.depth * max(1, ctx.world_size - 1),
                                channel=True)  # (polling, the idle I/O thread sleeps on it: ``_doze``)
        dev = self.device
        self.cache = RegistrationCache(lambda v: dev.register(v, 0), dev.close_region, o["registration_cache_bytes"])
        self.ctrl = np.zeros(64, np.uint8)
        self.ctrl_mr = dev.register(self.ctrl)
        self.ctrl_addr = self.ctrl.ctypes.data  # numpy makes a ctypes object per ``.ctypes``: once, here
        mine: dict[str, list[int]] = {}
        for peer in self.peers():
            qp = dev.queue_pair(self.depth, o["qp_timeout"], o["retry_count"])
            qp.to_init()
            ring = np.zeros(self.slots * self.slot_bytes, np.uint8)
            bounce = np.zeros(self.slots * self.bounce_bytes, np.uint8)
            link = _Link(peer, qp, ring, dev.register(ring), bounce, dev.register(bounce), self.slots,
                         self.bounce_bytes)
            link.reader = StreamReader(self.inbox(peer))
            self._post_recv(link, 2 * self.depth)
            self.links[peer] = self.by_qpn[qp.qpn] = link
            mine[str(peer)] = [qp.qpn, qp.psn, ring.ctypes.data, link.ring_mr.rkey]
        if o["native"] and ctx.peers is None:  # (not as one of several transports, ``paired``: it runs none whole)
            self.native = native.Native(dev.name, dev.port, dev.gid_index, ctx.world_size, self.peers(), self.slots,
                                        self.slot_bytes, o["qp_timeout"], o["retry_count"], self.spin,
                                        o["native_reduce_bytes"])
        me = {"gid": dev.gid, "slots": self.slots, "slot_bytes": self.slot_bytes,
              "native_reduce_bytes": o["native_reduce_bytes"], "peers": mine,
              "native": self.native.offer() if self.native is not None else None}
        ctx.store.set(self._key(ctx.job, self.rank), json.dumps(me).encode())
        for peer, link in self.links.items():
            theirs = json.loads(self._get(ctx, self._key(ctx.job, peer), deadline))
            for key in ("slots", "slot_bytes", "native_reduce_bytes"):
                if theirs.get(key) != me[key]:
                    raise ConfigError(f"config key 'transport.verbs.{key}': rank {peer} has {theirs.get(key)}, rank "
                                      f"{self.rank} has {me[key]}; every rank needs the same")
            if (theirs.get("native") is None) != (me["native"] is None):
                raise ConfigError(f"config key 'transport.verbs.native': rank {peer} has "
                                  f"{theirs.get('native') is not None}, rank {self.rank} has {me['native'] is not None}"
                                  "; every rank needs the same")
            qpn, psn, addr, rkey = theirs["peers"][str(self.rank)]
            link.qp.connect(rc.Address(qpn, theirs["gid"], psn))
            link.remote_addr, link.rkey = addr, rkey
            if self.native is not None:
                self.native.join(peer, theirs["native"], self.rank)
        ctx.store.set(self._key(ctx.job, self.rank) + "/ready", b"1")
        for peer in self.links:
            self._get(ctx, self._key(ctx.job, peer) + "/ready", deadline)
        log.info("rank %d: verbs on %s port %d (GID %s), %d queue pairs", self.rank, dev.name, dev.port, dev.gid,
                 len(self.links))
        self._thread = threading.Thread(target=self._run, name=f"erdma-verbs-{self.rank}", daemon=True)
        self._thread.start()

    @staticmethod
    def _key(job: int, rank: int) -> str:
        return f"verbs/{job & 0xFFFFFFFFFFFFFFFF:016x}/{rank}"

    def _get(self, ctx: TransportContext, key: str, deadline: float) -> bytes:
        return await_key(ctx, key, deadline,
                         lambda why: rc.VerbsError(f"rank {self.rank}: {why} (is that rank running with transport verbs?)"))

    def _post_recv(self, link: _Link, count: int = _REPOST) -> None:
        link.qp.post_recv(_RECV | link.peer, self.ctrl_addr, self.ctrl.nbytes, self.ctrl_mr.lkey, count)

    def _received(self, link: _Link) -> None:
        """A receive was used: post them again in batches (one call, the same chained requests each time)."""
        link.to_repost += 1
        if link.to_repost == _REPOST:
            link.to_repost = 0
            self._post_recv(link)

    # ---- the compiled path ----------------------------------------------------------------------------------
    def run_program(self, program: Program, buffers: Any, op: Op) -> bool:
        """A collective on the job's whole world, without a reduction or with one the compiled path computes
        (``native.takes``), runs whole on it (``native``); everything else goes through the executor."""
        nat = self.native
        if nat is None:
            return False
        with self._native_lock:
            if self.native is None or self.closing:  # closed meanwhile: the executor's calls fail as they should
                return False
            got = nat.prepare(program, buffers, op, self.world_size)
            if got is None:
                return False
            self._run_native(nat, *got, op)
            self.native_runs += 1
        return True

    def _run_native(self, nat: native.Native, msgs: Any, count: int, tag: int, op: Op) -> None:
        code = nat.run(msgs, count, tag, False)
        while code == 1:
            failed = self.failure()
            if failed is None and self.closing:  # closed from another thread: ``shutdown`` waits for this run
                failed = AbortedError(f"rank {self.rank}: the transport closed while {op.name} ({op.label}, seq "
                                      f"{op.seq}) ran on the compiled path", rank=self.rank, op=op.name)
            if failed is not None:
                raise op.failed(failed) if isinstance(failed, CollectiveError) else failed
            stray = self.mailbox.stray(op.group, op.seq)
            if stray is not None:
                self.abort(stray)
                raise op.failed(stray)
            if time.monotonic() > op.deadline:
                peer, doing = nat.waiting_on() or (-1, "waiting for")
                late = CollectiveTimeoutError(f"rank {self.rank}: {op.name} ({op.label}, seq {op.seq}) hit its timeout "
                                              f"of {op.timeout:.1f}s {doing} rank {peer} (verbs, compiled path)",
                                              rank=self.rank, op=op.name)
                self.abort(late)
                raise late
            code = nat.run(msgs, count, tag, True)
        if code == 0:
            return
        peer, why = nat.bad_peer(), nat.error()
        err: CollectiveError
        if code == -errno.EPROTO:
            err = MismatchError(f"rank {self.rank}: {why}: the ranks called different collectives at {op.name} "
                                f"({op.label}, seq {op.seq}), or the same with different sizes", rank=self.rank,
                                op=op.name)
        elif peer >= 0:
            err = self.peer_lost(peer, f"{why} (compiled path)")
        else:
            err = CollectiveError(f"rank {self.rank}: the compiled path failed: {why}", rank=self.rank, op=op.name)
        self.abort(err)
        first = self.failure() or err
        raise op.failed(first) if isinstance(first, CollectiveError) else first

    # ---- sending ------------------------------------------------------------------------------------------
    def post(self, peer: int, header: Header, payload: memoryview, deadline: float, req: Request,
             urgent: bool = False) -> None:
        link = self.links[peer]
        out = _Out(header.pack(), payload.cast("B") if payload.format != "B" else payload, req)
        with self._lock:
            if link.dead:
                req.complete(link.error or self.peer_lost(peer, "its queue pair is closed"))
                return
            if urgent and link.queue and link.queue[0].sent:
                link.queue.insert(1, out)  # not inside a frame already on its way
            elif urgent:
                link.queue.appendleft(out)
            else:
                link.queue.append(out)
            self._pump(link)

    def _pump(self, link: _Link) -> None:
        """Post what credits, send-queue room and send buffers allow (under the lock)."""
        while link.queue and len(link.posted) < self.depth - 1 and not link.dead:
            if self.slots - (link.sent - link.peer_freed) % _MOD <= 0:
                return
            out = link.queue[0]
            total = HEAD + out.payload.nbytes
            bounce = -1
            if out.sent == 0:
                if not link.free_bounce:
                    return
                bounce = link.free_bounce.pop()
                where = link.bounce_addr + bounce * link.bounce_bytes
                at = bounce * link.bounce_bytes
                link.bounce_view[at:at + HEAD] = out.head
                if out.payload.nbytes < self.zero_copy or not out.payload.nbytes:
                    link.bounce_view[at + HEAD:at + total] = out.payload
                    segments = [(where, total, link.bounce_mr.lkey)]
                    length = total
                else:
                    assert self.cache is not None
                    out.region, out.addr = self.cache.lookup(out.payload)
                    length = min(total, self.slot_bytes)
                    segments = [(where, HEAD, link.bounce_mr.lkey),
                                (out.addr, length - HEAD, out.region.lkey)]
            else:
                assert out.region is not None
                off = out.sent - HEAD
                length = min(total - out.sent, self.slot_bytes)
                segments = [(out.addr + off, length, out.region.lkey)]
            last = out.sent + length == total
            copied = last and out.region is None  # all of it in our send buffer: the caller's memory is free
            # signalled: what frees the caller's memory, and every few requests (what frees our send buffers
            # and room in the send queue; an unsignalled request is retired by the next signalled one)
            signal = (last and not copied) or link.unsignaled + 1 >= self.signal_every or not link.free_bounce
            self._ids += 1
            wr_id = self._ids
            slot = link.sent % self.slots
            try:
                link.qp.write_imm(wr_id, segments, link.remote_addr + slot * self.slot_bytes, link.rkey, length,
                                  signal)
            except Exception as exc:
                if bounce >= 0:
                    link.free_bounce.append(bounce)
                self._link_failed(link, f"posting a write failed: {exc}")
                return
            link.posted.append((wr_id, None if copied else out, bounce))
            link.unsignaled = 0 if signal else link.unsignaled + 1
            link.sent += 1
            link.last_send = time.monotonic()
            out.sent += length
            if not copied:
                out.pending += 1
                if out.region is not None:
                    out.region.users += 1
            if last:
                link.queue.popleft()
                if copied:
                    out.req.complete()

    def _credit(self, link: _Link, signal: bool = False) -> bool:
        """Tell the peer how many slots of its ring we have freed (also the keepalive), under the lock;
        ``signal``: ask for this request's completion (which retires every request posted before it). Whether
        it was posted."""
        if link.dead or len(link.posted) >= self.depth:
            return False
        signal = signal or link.unsignaled + 1 >= self.signal_every
        self._ids += 1
        try:
            link.qp.send_imm(self._ids, link.consumed % _MOD, self.ctrl_addr, 1, self.ctrl_mr.lkey, signal)
        except Exception as exc:
            self._link_failed(link, f"posting a credit failed: {exc}")
            return False
        link.posted.append((self._ids, None, -1))
        link.unsignaled = 0 if signal else link.unsignaled + 1
        link.reported = link.consumed
        link.last_send = time.monotonic()
        return True

    def _retire(self, link: _Link, wr_id: int, error: BaseException | None = None) -> None:
        """Request ``wr_id`` completed: so did every one posted to ``link`` before it (RC completes in order)."""
        while link.posted:
            done, out, bounce = link.posted.popleft()
            if bounce >= 0:
                link.free_bounce.append(bounce)
            if out is not None:
                out.pending -= 1
                if out.region is not None:
                    assert self.cache is not None
                    self.cache.done(out.region)
                if error is not None:
                    out.req.complete(error)
                elif out.pending == 0 and out.sent == HEAD + out.payload.nbytes:
                    out.req.complete()
            if done == wr_id:
                return

    def fail_sends(self, error: BaseException) -> None:
        """The rank aborts: every frame not yet on its way is dropped, and every send fails now (those in
        flight too: their completions no longer matter)."""
        with self._lock:
            for link in self.links.values():
                for out in link.queue:
                    out.req.complete(error)
                link.queue = deque(o for o in link.queue if o.sent)  # their remaining pieces still go
                for _, out, _ in link.posted:
                    if out is not None:
                        out.req.complete(error)

    # ---- receiving ----------------------------------------------------------------------------------------
    def _arrived(self, link: _Link, n: int) -> None:
        """A write of ``n`` bytes landed in the next slot of ``link``'s ring: hand them to the frame reader."""
        if not 0 < n <= self.slot_bytes:
            raise ProtocolError(f"rank {self.rank}: rank {link.peer} wrote {n} bytes into a {self.slot_bytes}-byte "
                                "slot")
        at = (link.consumed % self.slots) * self.slot_bytes
        data = link.ring_view[at:at + n]
        reader = link.reader
        assert reader is not None
        done = 0
        while done < n:
            buf = reader.buffer()
            take = min(len(buf), n - done)
            buf[:take] = data[done:done + take]
            reader.advance(take)
            done += take
        link.consumed += 1

    def _completed(self, wc: Any) -> None:
        wr_id = wc.wr_id
        link = self.links.get(wr_id & 0xFFFFFFFF) if wr_id & _RECV else self.by_qpn.get(wc.qp_num)
        if link is None:
            return
        if wc.status != rc.WC_SUCCESS:
            with self._lock:
                if link.error is None:
                    status = rc.status_name(wc.status)
                    why = (f"its queue pair stopped answering ({status} after {self.opts['retry_count']} resends: "
                           "the process or the path is gone)" if status == "RETRY_EXC_ERR"
                           else f"a work request completed with {status}")
                    self._link_failed(link, why)
                if not wr_id & _RECV:
                    self._retire(link, wr_id, link.error)
            return
        if not wr_id & _RECV:
            with self._lock:
                self._retire(link, wr_id)
                if link.consumed - link.reported >= self.credit_every:
                    self._credit(link)
                self._pump(link)
            return
        assert link is not None
        if wc.opcode == rc.WC_RECV_WRITE:
            try:
                self._arrived(link, wc.imm_data)
            except Exception as exc:
                with self._lock:
                    self._link_failed(link, exc)
                return
            with self._lock:
                self._received(link)
                if link.consumed - link.reported >= self.credit_every:
                    self._credit(link)
            return
        with self._lock:  # a credit (or keepalive)
            self._received(link)
            link.peer_freed = wc.imm_data
            self._pump(link)

    def _link_failed(self, link: _Link, why: object) -> None:
        """The queue pair to ``link.peer`` is gone (under the lock): a lost peer, unless it had said goodbye."""
        link.dead = True
        if self.inbox(link.peer).closed_cleanly or self.closing:
            link.error = PeerLostError(f"rank {self.rank}: rank {link.peer} closed its process group",
                                       peer=link.peer, rank=self.rank)
        else:
            link.error = self.peer_lost(link.peer, why)
        for out in link.queue:
            out.req.complete(link.error)
        link.queue.clear()

    # ---- progress -----------------------------------------------------------------------------------------
    def _progress(self, block: float = 0.0) -> bool | None:
        """Take the completions there are, in order, one thread at a time: True when there were some, None
        when another thread is taking them. With a completion channel and ``block`` > 0, sleep on the
        channel up to ``block`` seconds first when there are none."""
        if not self._cq_lock.acquire(blocking=False):
            return None
        try:
            dev = self.device
            if dev is None:
                return False
            wcs = dev.poll(64)
            if not wcs and block > 0 and dev.channel is not None:
                dev.arm()
                wcs = dev.poll(64)  # one that came before the request for an event
                if not wcs and dev.sleep(block):
                    wcs = dev.poll(64)
            for wc in wcs:
                self._completed(wc)
            return bool(wcs)
        finally:
            self._cq_lock.release()

    def wait(self, req: Request, deadline: float) -> bool:
        """The waiting thread takes completions itself (no hand-over from the I/O thread: that costs a
        wake-up per message). Polling, it yields the core for ``spin_us`` and then sleeps between polls with
        back-off; with a completion channel it sleeps on the channel."""
        self._waiting += 1
        try:
            pause, spin_until = 0.0, time.monotonic() + self.spin
            while not req.finished:
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    return False
                if self._stop:
                    req.settled(left)
                    continue
                if self.channel:
                    if self._progress(min(left, 0.05)) is None and not req.finished:
                        req.settled(min(left, 0.002))  # the I/O thread is taking them: it completes ``req``
                    continue
                if self._progress():
                    pause, spin_until = 0.0, time.monotonic() + self.spin
                elif now < spin_until:  # a reply is often microseconds away: yield the core, do not sleep yet
                    os.sched_yield()
                else:
                    time.sleep(min(pause, left))
                    pause = min(max(pause * 2, 1e-5), self.max_pause)
        finally:
            self._waiting -= 1
        if req.error is not None:
            raise req.error
        return True

    def _run(self) -> None:
        """The I/O thread: completions nobody waits for (credits, sends of non-blocking calls, messages that
        arrive before their receive), and keepalives."""
        pause, next_check = 1e-5, time.monotonic() + self.keepalive
        while not self._stop:
            try:
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + self.keepalive / 4
                    self._keepalives(now)
                if self._waiting:
                    time.sleep(0.005)  # a waiting thread takes the completions: stay out of its way
                elif self.channel:
                    self._progress(0.1)
                elif self._progress():
                    pause = 1e-5
                elif pause >= self.max_pause:  # idle a while (the compiled path's collectives use none of it)
                    self._doze(min(DOZE_S, max(0.0, next_check - now)))
                else:
                    time.sleep(pause)
                    pause = min(pause * 2, self.max_pause)
            except Exception as exc:  # a bug here must not leave the ranks hanging
                log.exception("rank %d: verbs I/O thread failed", self.rank)
                if self.mailbox is not None:
                    self.abort(rc.VerbsError(f"rank {self.rank}: verbs I/O thread failed: {exc!r}"), wait=False)
                return

    def _doze(self, seconds: float) -> None:
        """The idle I/O thread (``completion = "poll"``): sleep on the completion channel until a completion
        comes, up to ``seconds``, instead of polling every ``poll_max_us``; on emulated or shared cores those
        wake-ups cost a rank more than a small collective. The completion lock is not held while asleep: a
        thread that waits for a message meanwhile polls as before (its completions wake this one too, which
        then finds them taken)."""
        with self._cq_lock:
            dev = self.device
            if dev is None:
                return
            dev.arm()
            wcs = dev.poll(64)  # one that came before the request for an event makes none
            for wc in wcs:
                self._completed(wc)
        if not wcs and not self._stop and dev.sleep(seconds):
            self.woken += 1

    def _settle(self, deadline: float) -> None:
        """Until ``deadline``, let the I/O thread send what is queued and take the completions of what was
        posted (a last signalled credit on each link retires the unsignalled requests before it): on an RC
        queue pair a completion means the peer acknowledged the write. A peer that said goodbye (BYE) needs
        nothing more and may have destroyed its queue pair already, so that a request to it would be
        acknowledged by nobody and fail only after every resend (1 to 20 s on SoftRoCE): it is not waited for."""
        flushed: set[int] = set()
        while time.monotonic() < deadline:
            with self._lock:
                live = [link for link in self.links.values() if not link.dead and (link.queue or link.posted)
                        and not self.inbox(link.peer).closed_cleanly]
                for link in live:
                    if not link.queue and link.peer not in flushed and self._credit(link, signal=True):
                        flushed.add(link.peer)
            if not live:
                return
            time.sleep(0.001)
        log.warning("rank %d: closed with writes not acknowledged within %.0fs", self.rank, self.linger)

    def _keepalives(self, now: float) -> None:
        with self._lock:
            for link in self.links.values():
                if not link.dead and now - link.last_send >= self.keepalive \
                        and not self.inbox(link.peer).closed_cleanly:
                    self._credit(link)

    def shutdown(self) -> None:
        if self.settling and self._thread is not None and self._thread is not threading.current_thread():
            self._settle(time.monotonic() + self.linger)
        if self.native is not None and self._native_lock.acquire(timeout=2 * native.SLICE_S + 1.0):
            try:  # (a run in progress ends within its slice: the transport is closing, or aborted)
                self.native.close()
                self.native = None
            finally:
                self._native_lock.release()
        self._stop = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        with self._cq_lock, self._lock:
            for link in self.links.values():
                link.dead = True
            if self.cache is not None:
                self.cache.clear()
            if self.device is not None:
                self.device.close()
                self.device = None
