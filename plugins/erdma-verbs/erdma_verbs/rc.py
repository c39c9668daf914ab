"""Reliable-connected queue pairs on pyverbs. A ``Device`` opens one RDMA device port (context, protection
domain, one completion queue for every queue pair, optionally a completion channel to sleep on) and makes a
``QueuePair`` per peer, connected out of band by exchanging ``Address`` (QPN, GID, PSN) and moved
INIT -> RTR -> RTS, each transition's failure named. Work requests: receives, SEND with immediate (control)
and RDMA WRITE with immediate (data) from one or two registered segments. pyverbs is imported here, so only
where verbs are selected.
"""

from __future__ import annotations

import os
import random
import select
from typing import Any, NamedTuple

import numpy as np
from pyverbs import enums as e  # rdma-core 44 (Debian 12); 59 calls it pyverbs.libibverbs_enums
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ, CompChannel
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
ROCE_V2 = e.IBV_GID_TYPE_SYSFS_ROCE_V2  # what ibv_query_gid_type says of a RoCEv2 GID (1; not IBV_GID_TYPE_ROCE_V2)
WC_SUCCESS = e.IBV_WC_SUCCESS
WC_RECV = e.IBV_WC_RECV
WC_RECV_WRITE = e.IBV_WC_RECV_RDMA_WITH_IMM
_NO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_WRITES = 256  # one-segment requests a queue pair keeps for reuse, of each kind (``QueuePair._reused``)
_STATUS = {getattr(e, n): n[7:] for n in dir(e) if n.startswith("IBV_WC_") and n.endswith("_ERR")}


class VerbsError(RuntimeError):
    pass


class Address(NamedTuple):
    """What a peer needs to connect its queue pair to this one."""

    qpn: int
    gid: str
    psn: int


def status_name(status: int) -> str:
    """``IBV_WC_RETR_EXC_ERR`` -> "RETRY_EXC_ERR": a work completion's status as verbs names it."""
    return _STATUS.get(status, f"status {status}")


def device_names() -> list[str]:
    """The RDMA devices this host has ([] when it has none, or a kernel without RDMA)."""
    try:
        return [d.name.decode() for d in get_device_list()]
    except PyverbsError:
        return []


def roce_v2_gid(ctx: Any, port: int) -> int:
    """The index of the port's first RoCEv2 GID on an IPv4 address (``::ffff:a.b.c.d``), as an RC path over
    UDP/IP needs; VerbsError naming the device and what the table holds when there is none."""
    seen = []
    for index in range(ctx.query_port(port).gid_tbl_len):
        try:
            gid = str(ctx.query_gid(port, index))
            kind = ctx.query_gid_type(port, index)
        except PyverbsError:
            continue
        if gid.startswith("0000:0000:0000:0000:0000:ffff:") and kind == ROCE_V2:
            return index
        if gid != _NO_GID:
            seen.append(f"{index}: {gid} (type {kind})")
    raise VerbsError(f"{ctx.name}: port {port} has no RoCEv2 GID on an IPv4 address (GIDs: {seen or 'none'}); "
                     "give its network device an IPv4 address")


def _event_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if "infinibandevent" in os.readlink(f"/proc/self/fd/{name}"):
                fds.add(int(name))
        except OSError:
            continue
    return fds


class Device:
    """One port of an RDMA device: context, protection domain, a completion queue of ``cq_depth`` entries
    shared by every queue pair, and with ``channel`` a completion channel that ``sleep`` waits on.
    ``close`` releases everything made through it, newest first."""

    def __init__(self, name: str, port: int = 1, gid_index: int | None = None, cq_depth: int = 1024,
                 channel: bool = False) -> None:
        self.name, self.port = name, port
        self._closers: list[Any] = []
        self.channel: Any = None
        self.channel_fd = -1
        try:
            self.ctx = self._own(Context(name=name))
            self.gid_index = roce_v2_gid(self.ctx, port) if gid_index is None else gid_index
            self.gid = str(self.ctx.query_gid(port, self.gid_index))
            self.pd = self._own(PD(self.ctx))
            if channel:
                before = _event_fds()
                self.channel = self._own(CompChannel(self.ctx))
                fds = _event_fds() - before  # pyverbs does not expose the channel's fd; it is the new one
                if len(fds) != 1:
                    raise VerbsError(f"{name}: cannot find the completion channel's file descriptor ({fds})")
                self.channel_fd = fds.pop()
                os.set_blocking(self.channel_fd, False)
            self.cq = self._own(CQ(self.ctx, cq_depth, None, self.channel, 0))
        except PyverbsError as exc:
            self.close()
            raise VerbsError(f"{name} port {port}: {exc}") from None
        except BaseException:
            self.close()
            raise

    def _own(self, obj: Any) -> Any:
        self._closers.append(obj)
        return obj

    def queue_pair(self, depth: int, timeout: int = 18, retry: int = 6) -> QueuePair:
        """A new RC queue pair (``depth`` sends and ``2 * depth`` receives outstanding), not yet connected."""
        try:
            return QueuePair(self, depth, timeout, retry)
        except PyverbsError as exc:
            raise VerbsError(f"{self.name} port {self.port}: creating a queue pair: {exc}") from None

    def register(self, array: np.ndarray | memoryview, access: int = ACCESS) -> Any:
        """A memory region over ``array``'s own memory (zero-copy). ``close_region`` or ``close`` releases it."""
        arr = np.frombuffer(array, np.uint8) if isinstance(array, memoryview) else array
        try:
            return self._own(MR(self.pd, arr.nbytes, access, address=arr.ctypes.data))
        except PyverbsError as exc:
            raise VerbsError(f"{self.name}: registering {arr.nbytes} bytes: {exc}") from None

    def close_region(self, mr: Any) -> None:
        mr.close()
        self._closers.remove(mr)

    def poll(self, count: int) -> list[Any]:
        """Up to ``count`` completions, without waiting."""
        n, wcs = self.cq.poll(count)
        return wcs[:n]

    def arm(self) -> None:
        """Ask for an event on the channel at the next completion."""
        self.cq.req_notify()

    def sleep(self, seconds: float) -> bool:
        """With a channel: wait up to ``seconds`` for the event ``arm`` asked for (True when it came). Poll
        after ``arm``, before this: a completion that came just before the request makes no event."""
        ready, _, _ = select.select([self.channel_fd], [], [], seconds)
        if ready:
            self.channel.get_cq_event(self.cq)
            self.cq.ack_events(1)
        return bool(ready)

    def close(self) -> None:
        """Release the QPs, MRs, CQ, channel, PD and device context (newest first)."""
        while self._closers:
            self._closers.pop().close()


class QueuePair:
    def __init__(self, device: Device, depth: int, timeout: int, retry: int) -> None:
        self.device, self.timeout, self.retry = device, timeout, retry
        cap = QPCap(max_send_wr=depth, max_recv_wr=2 * depth + 8, max_send_sge=2, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=device.cq, rcq=device.cq, cap=cap, sq_sig_all=0)
        self.qp = device._own(QP(device.pd, init))
        self.qpn = self.qp.qp_num
        self.psn = random.randrange(1 << 24)
        self.inited = False
        self._recvs: dict[tuple[int, int, int, int, int], list[Any]] = {}
        self._sends: dict[tuple[int, int, int], Any] = {}
        self._writes: dict[tuple[int, int, int], Any] = {}

    def address(self) -> Address:
        return Address(self.qpn, self.device.gid, self.psn)

    def to_init(self) -> None:
        """RESET -> INIT: receives may be posted from here on."""
        self.inited = True
        attr = QPAttr(port_num=self.device.port)
        attr.qp_access_flags = ACCESS
        self._move("INIT", self.qp.to_init, attr)

    def connect(self, peer: Address) -> None:
        """(INIT, when not there yet) -> RTR towards ``peer`` -> RTS; VerbsError naming the failing move."""
        if not self.inited:
            self.to_init()
        port = self.device.port
        attr = QPAttr(port_num=port)
        attr.path_mtu = min(self.device.ctx.query_port(port).active_mtu, e.IBV_MTU_4096)
        attr.dest_qp_num, attr.rq_psn = peer.qpn, peer.psn
        attr.max_dest_rd_atomic, attr.min_rnr_timer = 1, 12
        route = GlobalRoute(dgid=GID(peer.gid), sgid_index=self.device.gid_index, hop_limit=64)
        attr.ah_attr = AHAttr(gr=route, is_global=1, port_num=port)
        self._move("RTR", self.qp.to_rtr, attr)
        attr = QPAttr(port_num=port)
        attr.sq_psn, attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = \
            self.psn, self.timeout, self.retry, 7, 1  # rnr_retry 7: retry without limit
        self._move("RTS", self.qp.to_rts, attr)

    def _move(self, state: str, how: Any, attr: Any) -> None:
        try:
            how(attr)
        except PyverbsError as exc:
            raise VerbsError(f"queue pair {self.qpn}: the move to {state} failed: {exc}") from None

    def post_recv(self, wr_id: int, address: int, length: int, lkey: int, count: int = 1) -> None:
        """Post ``count`` receives (chained: one call) of one segment each."""
        key = (wr_id, address, length, lkey, count)
        chain = self._recvs.get(key)
        if chain is None:  # made once and posted again: each pyverbs object costs a logger lookup and a malloc
            chain = [RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(address, length, lkey)])]
            for _ in range(count - 1):  # each links to the one before, which must stay alive: the list keeps it
                chain.append(RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(address, length, lkey)], next_wr=chain[-1]))
            self._recvs[key] = chain
        self.qp.post_recv(chain[-1])

    def send_imm(self, wr_id: int, imm: int, address: int, length: int, lkey: int, signal: bool = True) -> None:
        """SEND ``length`` bytes (at least one: pyverbs wants a segment) with the immediate ``imm``; without
        ``signal`` it makes no completion unless it fails."""
        self.qp.post_send(self._reused(self._sends, e.IBV_WR_SEND_WITH_IMM, (address, length, lkey), wr_id, imm,
                                       signal))

    def write_imm(self, wr_id: int, segments: list[tuple[int, int, int]], remote_addr: int, rkey: int,
                  imm: int, signal: bool = True) -> None:
        """RDMA WRITE of ``segments`` ((address, length, lkey), gathered in order) to the peer's
        ``remote_addr`` (``rkey``), consuming one of its receives, whose completion carries ``imm``. A
        one-segment write is a request made once and posted again (``_reused``): a transport copies short
        messages into a few fixed send buffers, so the same few segments come back."""
        if len(segments) == 1:
            wr = self._reused(self._writes, e.IBV_WR_RDMA_WRITE_WITH_IMM, segments[0], wr_id, imm, signal)
        else:
            sges = [SGE(a, n, k) for a, n, k in segments]
            wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=len(sges), sg=sges,
                        send_flags=e.IBV_SEND_SIGNALED if signal else 0, imm_data=imm)
        wr.set_wr_rdma(rkey, remote_addr)
        self.qp.post_send(wr)

    @staticmethod
    def _reused(kept: dict[tuple[int, int, int], Any], opcode: int, segment: tuple[int, int, int], wr_id: int,
                imm: int, signal: bool) -> Any:
        """The one-segment request of ``opcode`` over ``segment`` (address, length, lkey) from ``kept``, made
        the first time (making pyverbs objects, a logger lookup and a malloc each, is what a short message cost
        most in Python), with this post's id, immediate and flags. At most ``_WRITES`` are kept, all dropped
        when that many are: the lengths of copied messages vary."""
        wr = kept.get(segment)
        if wr is None:
            if len(kept) >= _WRITES:
                kept.clear()
            wr = kept[segment] = SendWR(opcode=opcode, num_sge=1, sg=[SGE(*segment)])
        wr.wr_id, wr.imm_data, wr.send_flags = wr_id, imm, e.IBV_SEND_SIGNALED if signal else 0
        return wr
