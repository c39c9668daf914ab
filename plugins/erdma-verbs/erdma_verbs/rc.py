"""Reliable-connected queue pairs on pyverbs: one ``Endpoint`` (protection domain, completion queue, queue pair)
per peer, connected out of band by exchanging ``Address`` (QPN, GID, PSN) and moved INIT -> RTR -> RTS, each
transition's failure named; registered buffers (``register``), posted receives, SEND and RDMA WRITE with
immediate, and completions polled with back-off up to a deadline. pyverbs is imported here, so only where
verbs are selected. The transport built on it (flow control, pipelining, the core's transport base) is not
written yet.
"""

from __future__ import annotations

import random
import time
from typing import Any, NamedTuple

import numpy as np
from pyverbs import enums as e  # rdma-core 44 (Debian 12); 59 calls it pyverbs.libibverbs_enums
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
ROCE_V2 = e.IBV_GID_TYPE_SYSFS_ROCE_V2  # what ibv_query_gid_type says of a RoCEv2 GID (1; not IBV_GID_TYPE_ROCE_V2)


class VerbsError(RuntimeError):
    pass


class Address(NamedTuple):
    """What a peer needs to connect its queue pair to this one."""

    qpn: int
    gid: str
    psn: int


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
        if gid != "0000:0000:0000:0000:0000:0000:0000:0000":
            seen.append(f"{index}: {gid} (type {kind})")
    raise VerbsError(f"{ctx.name}: port {port} has no RoCEv2 GID on an IPv4 address (GIDs: {seen or 'none'}); "
                     "give its network device an IPv4 address")


class Endpoint:
    """One queue pair (and its PD and CQ) on ``device``/``port`` for one peer."""

    def __init__(self, device: str, port: int = 1, gid_index: int | None = None, depth: int = 64,
                 timeout: int = 18) -> None:
        self.port, self.timeout = port, timeout
        self._closers: list[Any] = []
        try:
            self.ctx = self._own(Context(name=device))
            self.gid_index = roce_v2_gid(self.ctx, port) if gid_index is None else gid_index
            self.pd = self._own(PD(self.ctx))
            self.cq = self._own(CQ(self.ctx, 2 * depth))
            cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
            self.qp = self._own(QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)))
        except PyverbsError as exc:
            self.close()
            raise VerbsError(f"{device} port {port}: {exc}") from None
        self.psn = random.randrange(1 << 24)

    def _own(self, obj: Any) -> Any:
        self._closers.append(obj)
        return obj

    def address(self) -> Address:
        return Address(self.qp.qp_num, str(self.ctx.query_gid(self.port, self.gid_index)), self.psn)

    def connect(self, peer: Address) -> None:
        """INIT -> RTR (towards ``peer``) -> RTS; VerbsError naming the transition that failed."""
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = ACCESS
        self._move("INIT", self.qp.to_init, attr)
        attr = QPAttr(port_num=self.port)
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num, attr.rq_psn = peer.qpn, peer.psn
        attr.max_dest_rd_atomic, attr.min_rnr_timer = 1, 12
        route = GlobalRoute(dgid=GID(peer.gid), sgid_index=self.gid_index, hop_limit=64)
        attr.ah_attr = AHAttr(gr=route, is_global=1, port_num=self.port)
        self._move("RTR", self.qp.to_rtr, attr)
        attr = QPAttr(port_num=self.port)
        attr.sq_psn, attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = \
            self.psn, self.timeout, 7, 7, 1
        self._move("RTS", self.qp.to_rts, attr)

    def _move(self, state: str, how: Any, attr: Any) -> None:
        try:
            how(attr)
        except PyverbsError as exc:
            raise VerbsError(f"queue pair {self.qp.qp_num}: the move to {state} failed: {exc}") from None

    def register(self, array: np.ndarray) -> Any:
        """A memory region over ``array`` (zero-copy: the array's own memory), closed with the endpoint."""
        return self._own(MR(self.pd, array.nbytes, ACCESS, address=array.ctypes.data))

    def post_recv(self, mr: Any, array: np.ndarray, wr_id: int = 0) -> None:
        self.qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(array.ctypes.data, array.nbytes, mr.lkey)]))

    def send(self, mr: Any, array: np.ndarray, wr_id: int = 0) -> None:
        sge = SGE(array.ctypes.data, array.nbytes, mr.lkey)
        self.qp.post_send(SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge],
                                 send_flags=e.IBV_SEND_SIGNALED))

    def write_imm(self, mr: Any, array: np.ndarray, remote_addr: int, rkey: int, imm: int, wr_id: int = 0) -> None:
        """RDMA WRITE of ``array`` to the peer's ``remote_addr`` (``rkey``), with ``imm`` for its receive."""
        sge = SGE(array.ctypes.data, array.nbytes, mr.lkey)
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1, sg=[sge],
                    send_flags=e.IBV_SEND_SIGNALED, imm_data=imm)
        wr.set_wr_rdma(rkey, remote_addr)
        self.qp.post_send(wr)

    def poll(self, count: int, deadline: float) -> list[Any]:
        """``count`` completions (each checked for success), polling with back-off until ``deadline``."""
        got: list[Any] = []
        pause = 1e-5
        while len(got) < count:
            n, wcs = self.cq.poll(count - len(got))
            for wc in wcs[:n]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise VerbsError(f"queue pair {self.qp.qp_num}: work request {wc.wr_id} completed with "
                                     f"status {wc.status} (opcode {wc.opcode})")
            got += wcs[:n]
            if len(got) < count:
                if time.monotonic() > deadline:
                    raise VerbsError(f"queue pair {self.qp.qp_num}: {len(got)} of {count} completions by the "
                                     "deadline")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        return got

    def close(self) -> None:
        """Release the QP, CQ, MRs, PD and device context (in reverse order of creation)."""
        while self._closers:
            self._closers.pop().close()
