"""The compiled path (``transport.verbs.native``): a whole collective run by ``steps.c`` over queue pairs of
its own, one C call per 50 ms slice: Python is entered once per collective instead of once per message.
Collectives without reductions (all-to-all, all-gather, broadcast, scatter, gather) take it, and those with
one that ``reduce.c`` computes as numpy does (``reducible``: integers with every op, float32 and float64 with
sum, average and product); the rest go through the core's executor.

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

from erdma_core.sdk import Op, Program, ReduceOp

from . import rc
from ._ibv import ffi, lib

SLICE_S = 0.05  # how long one C call runs before the caller looks at the rest of the world (abort, deadline)
_BUFFERS = ("in", "out", "work")  # the executor's buffers, by the index messages name them


_OPS = {ReduceOp.SUM: lib.EV_SUM, ReduceOp.AVG: lib.EV_SUM, ReduceOp.PROD: lib.EV_PROD, ReduceOp.MIN: lib.EV_MIN,
        ReduceOp.MAX: lib.EV_MAX, ReduceOp.BAND: lib.EV_BAND, ReduceOp.BOR: lib.EV_BOR, ReduceOp.BXOR: lib.EV_BXOR}
_DTYPES = {"int8": lib.EV_INT8, "uint8": lib.EV_UINT8, "int16": lib.EV_INT16, "uint16": lib.EV_UINT16,
           "int32": lib.EV_INT32, "uint32": lib.EV_UINT32, "int64": lib.EV_INT64, "uint64": lib.EV_UINT64,
           "float32": lib.EV_FLOAT32, "float64": lib.EV_FLOAT64}


def reduction(op: Op) -> tuple[int, int] | None:
    """``op``'s reduction as ``reduce.c`` codes (op, dtype), or None where it does not compute it (AVG sums
    here; the core divides once at the end)."""
    red, dtype = _OPS.get(op.reduce_op), _DTYPES.get(op.dtype)  # type: ignore[arg-type]
    return (red, dtype) if red is not None and dtype is not None and lib.ev_reducible(red, dtype) else None


def takes(op: Op, world: int, slot_bytes: int, reduce_bytes: int) -> bool:
    """Whether the compiled path runs ``op``: the job's whole world, and no reduction, or one ``reduce.c``
    computes on at most ``reduce_bytes`` of data (``native_reduce_bytes``; a ring's worth by default; the
    executor offers uncompressed programs only). Decided from what every rank of a collective has alike (the
    op, its dtype and size, the settings every rank agreed on), so that all of them take it or none.

    Larger reductions stay on the message path, which sends them from the caller's memory: in the guest
    (2 ranks, float32 allreduce, ``benchmarks/run_allreduce.py``) the compiled path took 0.21-0.27x the
    message path's time at 4 KiB, 0.84-0.88x at 1 MiB, 0.99x at 4 MiB (the default ring; built with -O3 that
    run) and 1.29x at 16 MiB."""
    if op.group != 0 or len(op.ranks) != world:
        return False
    if op.reduce_op is None:
        return True
    red = reduction(op)
    if red is None:
        return False
    size = lib.ev_itemsize(red[1])
    return slot_bytes % size == 0 and op.numel * size <= reduce_bytes


def digest(op: Op) -> int:
    """8 bits of ``op``'s identity (opcode, dtype, size, root). Every piece of a collective carries its
    sequence number plus these: a rank that called another collective there fails the run instead of
    reading another's bytes (a different length fails it too)."""
    return zlib.crc32(repr((op.head, op.numel)).encode()) & 0xFF


class Native:
    def __init__(self, device: str, port: int, gid_index: int | None, world: int, peers: list[int], slots: int,
                 slot_bytes: int, qp_timeout: int, retry_count: int, spin: float, reduce_bytes: int) -> None:
        depth = slots + 8
        self.device = rc.Device(device, port, gid_index, cq_depth=4 * depth * max(1, len(peers)), channel=True)
        self.slot_bytes, self.reduce_bytes = slot_bytes, reduce_bytes or slots * slot_bytes
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
            taken = takes(op, world, self.slot_bytes, self.reduce_bytes)
            msgs = self._messages(program, buffers, reduction(op)) if taken else None
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
    def _messages(program: Program, buffers: Mapping[str, np.ndarray], red: tuple[int, int] | None) -> Any:
        """``program``'s copies, sends and receives, step by step, as the C side takes them; a reducing
        receive combines by ``red`` (``reduction``)."""
        size = buffers["out"].itemsize
        red_op, red_dtype = red or (0, 0)
        rows = []
        for i, st in enumerate(program.stages):
            for c in st.copies:
                rows.append((i, lib.EV_COPY, -1, _BUFFERS.index(c.dst), _BUFFERS.index(c.src), c.count * size,
                             c.dst_offset * size, c.src_offset * size, 0, 0))
            for m in st.sends:
                rows.append((i, lib.EV_SEND, m.to, _BUFFERS.index(m.buf), 0, m.nbytes, m.offset * size, 0, 0, 0))
            for m in st.recvs:
                kind, how = (lib.EV_RECV_REDUCE, (red_op, red_dtype)) if m.reduce else (lib.EV_RECV, (0, 0))
                rows.append((i, kind, m.to, _BUFFERS.index(m.buf), 0, m.nbytes, m.offset * size, 0, *how))
        arr = ffi.new("ev_msg[]", len(rows))
        for i, row in enumerate(rows):
            e = arr[i]
            e.step, e.kind, e.peer, e.buf, e.src_buf, e.len, e.at, e.src, e.op, e.dtype = row
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
