"""The compiled path (``transport.verbs.native``): a whole collective without reductions (all-to-all,
all-gather, broadcast, scatter, gather) run by ``steps.c`` over queue pairs of its own, one C call per 50 ms
slice: Python is entered once per collective instead of once per message.

``Native`` holds a second device context (its own completion queue: the message path's I/O thread never
takes these completions), a queue pair, a receive ring and a send buffer per peer, and each program's
messages as C structures (offsets in the buffers ``in``, ``out`` and ``work``), built the first time the
program runs; per call only the buffers' addresses are passed. Its queue pairs are connected through the
same store record as the message path's.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from erdma_core.sdk import Op, Program

from . import rc
from ._ibv import ffi, lib

SLICE_S = 0.05  # how long one C call runs before the caller looks at the rest of the world (abort, deadline)
_BUFFERS = ("in", "out", "work")  # the executor's buffers, by the index messages name them


def takes(op: Op, world: int) -> bool:
    """Whether the compiled path runs ``op``: the job's whole world and no reduction (the executor offers
    uncompressed programs only). Decided from what every rank of a collective has alike, so that all of them
    take it or none: an op without a reduce op has no reducing receive on any rank."""
    return op.group == 0 and len(op.ranks) == world and op.reduce_op is None


def digest(op: Op) -> int:
    """8 bits of ``op``'s identity (opcode, dtype, size, root). Every piece of a collective carries its
    sequence number plus these: a rank that called another collective there fails the run instead of
    reading another's bytes (a different length fails it too)."""
    return zlib.crc32(repr((op.head, op.numel)).encode()) & 0xFF


class Native:
    def __init__(self, device: str, port: int, gid_index: int | None, world: int, peers: list[int], slots: int,
                 slot_bytes: int, qp_timeout: int, retry_count: int, spin: float) -> None:
        depth = slots + 8
        self.device = rc.Device(device, port, gid_index, cq_depth=4 * depth * max(1, len(peers)), channel=True)
        self.steps: Any = ffi.NULL
        try:
            dev = self.device
            self.ctrl = np.zeros(64, np.uint8)
            self.ctrl_mr = dev.register(self.ctrl)
            self.links: dict[int, tuple[rc.QueuePair, np.ndarray, rc.Region, np.ndarray, rc.Region]] = {}
            for peer in peers:
                qp = dev.queue_pair(depth, qp_timeout, retry_count)
                qp.to_init()
                ring, bounce = np.zeros(slots * slot_bytes, np.uint8), np.zeros(slots * slot_bytes, np.uint8)
                self.links[peer] = (qp, ring, dev.register(ring), bounce, dev.register(bounce))
            self.steps = lib.ev_steps_new(dev.dev, world, slots, slot_bytes, self.ctrl.ctypes.data, spin)
            if self.steps == ffi.NULL:
                raise rc.VerbsError("the compiled path: out of memory")
        except BaseException:
            self.close()
            raise
        self._bases = ffi.new("void *[]", len(_BUFFERS))  # the current run's buffers
        self._programs: dict[int, tuple[Program, Any, int]] = {}  # id -> (it, its messages or None, its op's digest)

    def offer(self) -> dict[str, Any]:
        """What the peers need to connect to this rank's path: its GID, and per peer (QPN, PSN, ring, rkey)."""
        return {"gid": self.device.gid,
                "peers": {str(p): [qp.qpn, qp.psn, ring.ctypes.data, mr.rkey]
                          for p, (qp, ring, mr, _, _) in self.links.items()}}

    def join(self, peer: int, theirs: Mapping[str, Any], me: int) -> None:
        """Connect to ``peer`` from what it offered (``theirs``), and post this link's receives."""
        qp, ring, _, bounce, bounce_mr = self.links[peer]
        qpn, psn, addr, rkey = theirs["peers"][str(me)]
        qp.connect(rc.Address(qpn, theirs["gid"], psn))
        if lib.ev_steps_peer(self.steps, peer, qp.qp, addr, rkey, ring.ctypes.data, bounce.ctypes.data,
                             bounce_mr.lkey, self.ctrl_mr.lkey) != 0:
            raise rc.VerbsError(self.error())

    def prepare(self, program: Program, buffers: Mapping[str, np.ndarray], op: Op, world: int
                ) -> tuple[Any, int, int] | None:
        """What ``run`` takes for ``program`` on ``buffers`` (its messages, their count, the tag of ``op``),
        or None when this path does not run it. The messages are worked out once per program (as offsets in
        the buffers ``in``, ``out`` and ``work``); per call only the buffers' addresses are read. The
        core's buffers are flat and contiguous (``engine.buffers.as_buffer``, the runner's scratch)."""
        known = self._programs.get(id(program))
        if known is None or known[0] is not program:
            if len(self._programs) >= 256:
                self._programs.clear()
            msgs = self._messages(program, buffers) if takes(op, world) else None
            known = self._programs[id(program)] = (program, msgs, digest(op))
        msgs = known[1]
        if msgs is None:
            return None
        bases, get, view = self._bases, buffers.get, ffi.from_buffer
        a, b, c = get("in"), get("out"), get("work")  # (_BUFFERS' order)
        bases[0] = ffi.NULL if a is None else view(a)
        bases[1] = ffi.NULL if b is None else view(b)
        bases[2] = ffi.NULL if c is None else view(c)
        return msgs, len(msgs), (op.seq + known[2]) & 0xFF

    @staticmethod
    def _messages(program: Program, buffers: Mapping[str, np.ndarray]) -> Any:
        """``program``'s copies, sends and receives, step by step, as the C side takes them."""
        size = buffers["out"].itemsize
        rows = []
        for i, st in enumerate(program.stages):
            for c in st.copies:
                rows.append((i, lib.EV_COPY, -1, _BUFFERS.index(c.dst), _BUFFERS.index(c.src), c.count * size,
                             c.dst_offset * size, c.src_offset * size))
            for kind, msgs in ((lib.EV_SEND, st.sends), (lib.EV_RECV, st.recvs)):
                for m in msgs:
                    rows.append((i, kind, m.to, _BUFFERS.index(m.buf), 0, m.nbytes, m.offset * size, 0))
        arr = ffi.new("ev_msg[]", len(rows))
        for i, row in enumerate(rows):
            e = arr[i]
            e.step, e.kind, e.peer, e.buf, e.src_buf, e.len, e.at, e.src = row
        return arr

    def run(self, msgs: Any, count: int, tag: int, resume: bool) -> int:
        """One slice of a run: 0 done, 1 call again (``resume``), negative failed (``error``, ``bad_peer``)."""
        return int(lib.ev_steps_run(self.steps, msgs, count, self._bases, tag, SLICE_S, int(resume)))

    def error(self) -> str:
        return ffi.string(lib.ev_steps_error(self.steps)).decode(errors="replace")

    def bad_peer(self) -> int:
        return int(lib.ev_steps_bad_peer(self.steps))

    def waiting_on(self) -> tuple[int, str] | None:
        """The peer and direction ("sending to", "waiting for") of the first move of the current step not done."""
        kind = ffi.new("int *")
        peer = lib.ev_steps_waiting(self.steps, kind)
        if peer < 0:
            return None
        return int(peer), "sending to" if kind[0] == lib.EV_SEND else "waiting for"

    def close(self) -> None:
        if self.steps not in (None, ffi.NULL):
            lib.ev_steps_free(self.steps)
        self.steps = ffi.NULL
        self._programs.clear()
        self.device.close()
