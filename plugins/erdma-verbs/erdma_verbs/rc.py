"""Reliable-connected queue pairs on libibverbs, through the C side built at install (``ibv.c``, cffi): a
post or a poll is one C call, with no Python object made per request. A ``Device`` opens one RDMA device port
(context, protection domain, one completion queue for every queue pair, optionally a completion channel to
sleep on) and makes a ``QueuePair`` per peer, connected out of band by exchanging ``Address`` (QPN, GID, PSN)
and moved INIT -> RTR -> RTS, each transition's failure named. Work requests: receives, SEND with immediate
(control) and RDMA WRITE with immediate (data) from one or two registered segments. The C side is imported
here, so only where verbs are selected.
"""

from __future__ import annotations

import random
import select
from typing import Any, NamedTuple

import numpy as np

from ._ibv import ffi, lib

ACCESS = lib.IBV_ACCESS_LOCAL_WRITE | lib.IBV_ACCESS_REMOTE_WRITE | lib.IBV_ACCESS_REMOTE_READ
WC_SUCCESS = lib.IBV_WC_SUCCESS
WC_RECV = lib.IBV_WC_RECV
WC_RECV_WRITE = lib.IBV_WC_RECV_RDMA_WITH_IMM
_NO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_POLL = 64  # completions one poll takes at most


class VerbsError(RuntimeError):
    pass


class Address(NamedTuple):
    """What a peer needs to connect its queue pair to this one."""

    qpn: int
    gid: str
    psn: int


class WC(NamedTuple):
    """One work completion: ``imm_data`` is 0 for one that carried no immediate."""

    wr_id: int
    qp_num: int
    status: int
    opcode: int
    byte_len: int
    imm_data: int


class Region(NamedTuple):
    """A registered memory region: its keys, and the handle ``Device.close_region`` releases."""

    handle: Any
    lkey: int
    rkey: int


def _error(what: str) -> str:
    return f"{what}: {ffi.string(lib.ev_error()).decode(errors='replace')}"


def status_name(status: int) -> str:
    """``IBV_WC_RETR_EXC_ERR`` -> "RETRY_EXC_ERR": a work completion's status as verbs names it."""
    return ffi.string(lib.ev_status_name(status)).decode() or f"status {status}"


def device_names() -> list[str]:
    """The RDMA devices this host has ([] when it has none, or a kernel without RDMA)."""
    out = ffi.new("char[]", 1 << 16)
    if lib.ev_device_names(out, len(out)) < 0:
        return []
    return ffi.string(out).decode().split()


def gid_text(raw: bytes) -> str:
    """A GID as verbs prints it: eight groups of four hex digits."""
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


def roce_v2_gid(dev: Device) -> int:
    """The index of the port's first RoCEv2 GID on an IPv4 address (``::ffff:a.b.c.d``), as an RC path over
    UDP/IP needs; VerbsError naming the device and what the table holds when there is none."""
    seen = []
    for index in range(dev.gid_table_len()):
        gid, v2 = dev.query_gid(index)
        if gid is None:
            continue
        if gid.startswith("0000:0000:0000:0000:0000:ffff:") and v2:
            return index
        if gid != _NO_GID:
            seen.append(f"{index}: {gid} ({'RoCEv2' if v2 else 'not RoCEv2'})")
    raise VerbsError(f"{dev.name}: port {dev.port} has no RoCEv2 GID on an IPv4 address (GIDs: {seen or 'none'}); "
                     "give its network device an IPv4 address")


class Device:
    """One port of an RDMA device: context, protection domain, a completion queue of ``cq_depth`` entries
    shared by every queue pair, and with ``channel`` a completion channel that ``sleep`` waits on.
    ``close`` releases everything made through it, newest first."""

    def __init__(self, name: str, port: int = 1, gid_index: int | None = None, cq_depth: int = 1024,
                 channel: bool = False) -> None:
        self.name, self.port = name, port
        self._closers: list[tuple[Any, Any]] = []  # (release function, handle), in the order made
        self._wcs = ffi.new("ev_wc[]", _POLL)
        self.dev = lib.ev_open(name.encode(), port, cq_depth, 1 if channel else 0)
        if self.dev == ffi.NULL:
            raise VerbsError(_error(f"{name} port {port}"))
        try:
            self.gid_index = roce_v2_gid(self) if gid_index is None else gid_index
            gid, _ = self.query_gid(self.gid_index)
            if gid is None:
                raise VerbsError(f"{name} port {port}: GID {self.gid_index} is empty")
            self.gid = gid
            self.active_mtu = lib.ev_active_mtu(self.dev)  # (queried at open, with the GID table's length)
        except BaseException:
            self.close()
            raise
        self.channel_fd = lib.ev_channel_fd(self.dev)
        self.channel = True if channel else None

    def gid_table_len(self) -> int:
        return int(lib.ev_gid_table_len(self.dev))

    def query_gid(self, index: int) -> tuple[str | None, bool]:
        """GID ``index`` as text and whether it is a RoCEv2 one; (None, False) for an entry that cannot be read
        (an empty one)."""
        raw, v2 = ffi.new("unsigned char[16]"), ffi.new("int *")
        if lib.ev_gid(self.dev, index, raw, v2) < 0:
            return None, False
        return gid_text(bytes(ffi.buffer(raw))), bool(v2[0])

    def queue_pair(self, depth: int, timeout: int = 18, retry: int = 6) -> QueuePair:
        """A new RC queue pair (``depth`` sends and ``2 * depth`` receives outstanding), not yet connected."""
        qp = lib.ev_qp_new(self.dev, depth, 2 * depth + 8)
        if qp == ffi.NULL:
            raise VerbsError(_error(f"{self.name} port {self.port}: creating a queue pair"))
        self._closers.append((lib.ev_qp_free, qp))
        return QueuePair(self, qp, timeout, retry)

    def register(self, array: np.ndarray | memoryview, access: int = ACCESS) -> Region:
        """A memory region over ``array``'s own memory (zero-copy). ``close_region`` or ``close`` releases it."""
        arr = np.frombuffer(array, np.uint8) if isinstance(array, memoryview) else array
        mr = lib.ev_reg(self.dev, arr.ctypes.data, arr.nbytes, access)
        if mr == ffi.NULL:
            raise VerbsError(_error(f"{self.name}: registering {arr.nbytes} bytes"))
        self._closers.append((lib.ev_dereg, mr))
        return Region(mr, lib.ev_lkey(mr), lib.ev_rkey(mr))

    def close_region(self, mr: Region) -> None:
        """Release ``mr``; nothing when ``close`` released it already."""
        try:
            self._closers.remove((lib.ev_dereg, mr.handle))
        except ValueError:
            return
        lib.ev_dereg(mr.handle)

    def poll(self, count: int) -> list[WC]:
        """Up to ``count`` (at most 64) completions, without waiting."""
        wcs = self._wcs
        if self.dev is None:
            raise VerbsError(f"{self.name}: the device is closed")
        n = lib.ev_poll(self.dev, wcs, count)
        if n < 0:
            raise VerbsError(_error(self.name))
        return [WC(w.wr_id, w.qp_num, w.status, w.opcode, w.byte_len, w.imm_data) for w in wcs[0:n]] if n else []

    def arm(self) -> None:
        """Ask for an event on the channel at the next completion."""
        if lib.ev_arm(self.dev) < 0:
            raise VerbsError(_error(self.name))

    def sleep(self, seconds: float) -> bool:
        """With a channel: wait up to ``seconds`` for the event ``arm`` asked for (True when it came). Poll
        after ``arm``, before this: a completion that came just before the request makes no event."""
        ready, _, _ = select.select([self.channel_fd], [], [], seconds)
        if ready and lib.ev_take_event(self.dev) < 0:
            raise VerbsError(_error(self.name))
        return bool(ready)

    def close(self) -> None:
        """Release the QPs, MRs, CQ, channel, PD and device context (newest first)."""
        while self._closers:
            release, handle = self._closers.pop()
            release(handle)
        if self.dev not in (None, ffi.NULL):
            lib.ev_close(self.dev)
        self.dev = None


class QueuePair:
    def __init__(self, device: Device, qp: Any, timeout: int, retry: int) -> None:
        self.device, self.qp, self.timeout, self.retry = device, qp, timeout, retry
        self.qpn = lib.ev_qpn(qp)
        self.psn = random.randrange(1 << 24)
        self.inited = False
        self._segs = ffi.new("unsigned long long[6]")

    def address(self) -> Address:
        return Address(self.qpn, self.device.gid, self.psn)

    def to_init(self) -> None:
        """RESET -> INIT: receives may be posted from here on."""
        self.inited = True
        self._check(lib.ev_qp_init(self._live(), self.device.port, ACCESS))

    def connect(self, peer: Address) -> None:
        """(INIT, when not there yet) -> RTR towards ``peer`` -> RTS; VerbsError naming the failing move."""
        if not self.inited:
            self.to_init()
        dev = self.device
        dgid = bytes.fromhex(peer.gid.replace(":", ""))
        self._check(lib.ev_qp_rtr(self._live(), dev.port, min(dev.active_mtu, lib.IBV_MTU_4096), peer.qpn, peer.psn,
                                  dgid, dev.gid_index))
        self._check(lib.ev_qp_rts(self.qp, self.psn, self.timeout, self.retry))  # rnr_retry 7: retry without limit

    def post_recv(self, wr_id: int, address: int, length: int, lkey: int, count: int = 1) -> None:
        """Post ``count`` receives (chained: one call) of one segment each."""
        self._check(lib.ev_post_recv(self._live(), wr_id, address, length, lkey, count))

    def send_imm(self, wr_id: int, imm: int, address: int, length: int, lkey: int, signal: bool = True) -> None:
        """SEND ``length`` bytes with the immediate ``imm``; without ``signal`` it makes no completion unless it
        fails."""
        segs = self._segs
        segs[0], segs[1], segs[2] = address, length, lkey
        self._check(lib.ev_post_send(self._live(), 0, wr_id, imm, segs, 1, 0, 0, signal))

    def write_imm(self, wr_id: int, segments: list[tuple[int, int, int]], remote_addr: int, rkey: int,
                  imm: int, signal: bool = True) -> None:
        """RDMA WRITE of ``segments`` ((address, length, lkey), gathered in order, one or two) to the peer's
        ``remote_addr`` (``rkey``), consuming one of its receives, whose completion carries ``imm``."""
        if not 0 < len(segments) <= 2:
            raise VerbsError(f"{len(segments)} segments (1 to 2)")
        segs = self._segs
        for i, (a, n, k) in enumerate(segments):
            segs[3 * i], segs[3 * i + 1], segs[3 * i + 2] = a, n, k
        self._check(lib.ev_post_send(self._live(), 1, wr_id, imm, segs, len(segments), remote_addr, rkey, signal))

    def _live(self) -> Any:
        """The queue pair's handle; VerbsError once its device closed (and released it): a post then must not
        reach freed memory."""
        if self.device.dev is None:
            raise VerbsError(f"queue pair {self.qpn}: its device is closed")
        return self.qp

    @staticmethod
    def _check(rc: int) -> None:
        if rc < 0:
            raise VerbsError(ffi.string(lib.ev_error()).decode(errors="replace"))
