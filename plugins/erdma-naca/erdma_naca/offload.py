"""The ``naca`` algorithm: allreduce, broadcast and reduce_scatter through an aggregation node, one object
per process group (``erdma_core.engine.offload``).

Set-up (the first naca collective of a group): every rank JOINs every configured node, and the ranks agree
through the host channel on the first node all of them joined; none (not configured, unreachable, refused,
out of slots): the group's collectives run the host algorithm (R2), and the log and
``ProcessGroup.counters()`` say why. After ``reprobe_after`` collectives on the hosts (counted alike on every
rank, so the ranks try at the same collective) they try the nodes again, and go back to the first they all
join; after each try that finds none they wait twice as long, up to 64 times.

Failover (R11): a rank whose node stops answering (``NodeGone``) joins the other nodes again and the ranks
agree, through the host channel, on the next node all of them reach, or on the hosts. They also tell each
other which collective each is in: a rank may have received every result of collective m (and gone on to
m+1) while another lost some when the node died. Then the lowest such rank sends m's result (allreduce,
broadcast: it keeps the last result) to the others over the host channel, or, for reduce_scatter, whose
results are per rank, the ranks run m again with the ring on the hosts (it keeps the last input). The
collective in flight is then run again from its untouched input (results land in scratch memory until the
last chunk is in), on the new node or on the hosts. Every rank ends with the same result for every
collective.
"""

from __future__ import annotations

import logging
import socket
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from erdma_core.sdk import (
    CollectiveTimeoutError,
    ConfigError,
    Fallback,
    MismatchError,
    OffloadCall,
    OffloadContext,
    ProtocolError,
    ReduceOp,
)
from erdma_core.toolkit import dtypes

from . import header as H
from .link import Chunk, Link, NodeError, NodeGone, NodeRefused
from .options import settings

log = logging.getLogger("erdma.naca")
HOST_ALGORITHM = {"broadcast": "tree", "reduce_scatter": "ring"}  # allreduce: the option ``fallback``


@dataclass
class _Kept:
    """What a rank keeps of its last collective done on a node, for a peer that missed its result."""

    message: int
    op: str
    dtype: str
    count: int
    reduce_op: Any
    data: np.ndarray  # allreduce, broadcast: the result; reduce_scatter: the input


class Naca:
    def __init__(self, ctx: OffloadContext) -> None:
        if ctx.size > H.MAX_RANKS:
            raise ConfigError(f"collectives: naca aggregates at most {H.MAX_RANKS} ranks per group; this group "
                              f"has {ctx.size}")
        self.ctx = ctx
        self.s = settings(ctx.config.section("algorithm.allreduce.naca"))
        self.key = ctx.key(b"naca")
        self.active: int | None = None
        self.reason = ""
        self.opened = False
        self.links: dict[int, Link] = {}
        self.seq = 0  # next chunk sequence number, the same on every rank
        self.kept: _Kept | None = None
        self._scratch: list[np.ndarray] = [np.empty(0, np.uint8), np.empty(0, np.uint8)]
        self._turn = 0
        self.failovers = 0
        self.settled = 0  # collectives settled on the hosts at a failover because some rank had finished them
        self.returns = 0  # times the group went back to a node after a run on the hosts
        self._hosted = 0  # collectives run on the hosts since the nodes were last tried
        self._wait = self.s.reprobe_after  # ... before they are tried again

    # ---- the Offload protocol ---------------------------------------------------------------------------
    def run(self, call: OffloadCall) -> Fallback | None:
        if not self.opened:
            self._open(call)
        elif self.active is None and self.s.nodes and self._hosted >= self._wait:
            self._retry(call)
        while True:
            if self.active is None:
                self._hosted += 1
                algo = HOST_ALGORITHM.get(call.op, self.s.fallback)
                return Fallback(algo, self.reason)
            try:
                self._on_node(call, self.links[self.active])
                return None
            except (NodeGone, NodeRefused) as exc:
                if self._failover(call, f"{self.s.nodes[self.active]} failed: {exc}"):
                    return None

    def close(self) -> None:
        for i, link in self.links.items():
            if i == self.active:
                link.leave()
            link.close()
        self.links.clear()

    def counters(self) -> dict[str, int]:
        out = {"failovers": self.failovers, "settled": self.settled, "returns": self.returns}
        for link in self.links.values():
            for k, v in vars(link.counters).items():
                out[k] = out.get(k, 0) + v
        return out

    # ---- set-up and failover ----------------------------------------------------------------------------
    def _probe(self, order: list[int]) -> tuple[int, list[str]]:
        """JOIN the nodes in ``order``: a bitmap of those that took the job, and why the others did not."""
        mask, why = 0, []
        for i in order:
            link = self.links.get(i)
            try:
                if link is None:
                    link = self.links[i] = self._link(i)
                link.join(self.s.slots, self.s.join_timeout)
                mask |= 1 << i
            except (NodeGone, NodeRefused, OSError) as exc:
                why.append(f"{self.s.nodes[i]}: {exc}")
        return mask, why

    def _link(self, i: int) -> Link:
        host, port = self.s.addresses[i]
        try:
            addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        except socket.gaierror as exc:
            raise NodeGone(f"cannot resolve {host!r}: {exc.strerror}") from None
        return Link(addr, job=self.ctx.job, group=self.ctx.group, rank=self.ctx.rank, size=self.ctx.size,
                    key=self.key, admission=self.s.admission, node_timeout=self.s.node_timeout,
                    rto_min=self.s.rto_min, rto_max=self.s.rto_max, loss=self.s.inject_loss)

    def _agree(self, call: OffloadCall, order: list[int], after: str) -> np.ndarray:
        """Probe ``order``, exchange with every rank, and set ``active`` to the first node in ``order``
        every rank joined (None: the hosts). Returns the exchanged rows (list hash, message, next seq, mask)."""
        mask, why = self._probe(order) if self.s.nodes else (0, [])
        listed = zlib.crc32(",".join(self.s.nodes).encode())
        rows = self.ctx.host.allgather([listed, call.seq, self.seq + self._chunks_of(call), mask])
        if len(set(rows[:, 0].tolist())) > 1:
            raise ConfigError(f"rank {self.ctx.ranks[self.ctx.rank]}: the ranks of group {self.ctx.group} name "
                              f"different aggregation nodes ([algorithm.allreduce.naca] nodes / ERDMA_NACA_NODES); "
                              f"this rank's: {','.join(self.s.nodes) or '(none)'}")
        common = int(np.bitwise_and.reduce(rows[:, 3]))
        self.active = next((i for i in order if common >> i & 1), None)
        for i in order:  # the nodes this rank joined and will not use now: their slots back
            if mask >> i & 1 and i != self.active:
                self.links[i].leave()
        if self.active is None:
            if not self.s.nodes:
                self.reason = "no aggregation node configured ([algorithm.allreduce.naca] nodes or ERDMA_NACA_NODES)"
            else:
                missing = [f"rank {self.ctx.ranks[r]} could not join {self.s.nodes[i]}" for r in range(self.ctx.size)
                           for i in order if not rows[r, 3] >> i & 1]
                self.reason = (f"{after}no aggregation node every rank joined: " + "; ".join(missing[:4])
                               + (f" (this rank: {'; '.join(why)})" if why else ""))
        else:
            self.reason = ""
            log.info("rank %d: group %d aggregates on %s", self.ctx.ranks[self.ctx.rank], self.ctx.group,
                     self.s.nodes[self.active])
        return rows

    def _open(self, call: OffloadCall) -> None:
        self._agree(call, list(range(len(self.s.nodes))), "")
        self.opened = True

    def _retry(self, call: OffloadCall) -> None:
        """Try the nodes again after a run on the hosts (every rank at the same collective)."""
        self._hosted = 0
        self._agree(call, list(range(len(self.s.nodes))), "")
        if self.active is None:
            self._wait = min(2 * self._wait, 64 * self.s.reprobe_after)
            return
        self._wait = self.s.reprobe_after
        self.returns += 1
        log.warning("rank %d: group %d is back on aggregation node %s", self.ctx.ranks[self.ctx.rank],
                    self.ctx.group, self.s.nodes[self.active])

    def _failover(self, call: OffloadCall, what: str) -> bool:
        """The active node failed during ``call``: agree on the next and settle the collective some rank
        may have finished; True if ``call`` is complete."""
        self.failovers += 1
        me = self.ctx.ranks[self.ctx.rank]
        log.warning("rank %d: %s (group %d, seq %d): %s; failing over", me, call.op, self.ctx.group, call.seq, what)
        failed = self.active if self.active is not None else -1
        if failed >= 0:  # a node still alive (silent only to this rank) lets the ranks waiting there go too
            self.links[failed].leave(give_up=True)
        n = len(self.s.nodes)
        order = [(failed + 1 + k) % n for k in range(n)]  # the failed node last: it may only have forgotten the job
        # every rank out of the collective before any JOINs again: a node that forgot the job takes a JOIN as
        # a new job, which DATA still coming from a rank that has not joined it would end (aggregator._forgot)
        self.ctx.host.allgather([call.seq])
        rows = self._agree(call, order, what + "; ")
        self.seq = int(rows[:, 2].max())
        messages = rows[:, 1]
        low = int(messages.min())
        if int(messages.max()) > low + 1:
            raise ProtocolError(f"rank {me}: naca failover found ranks {int(messages.max()) - low} collectives apart "
                                f"(group {self.ctx.group})")
        ahead = [r for r in range(self.ctx.size) if messages[r] == low + 1]
        if not ahead:
            return False  # nobody finished it: run it again where the ranks agreed
        root = ahead[0]
        self.settled += 1
        if call.seq == low + 1:  # this rank finished ``low``: give it to the others
            k = self.kept
            if k is None or k.message != low:
                raise ProtocolError(f"rank {me}: naca failover needs collective #{low} of group {self.ctx.group}, "
                                    f"which this rank no longer holds")
            self._settle(k.op, k.data, k.count, k.dtype, k.reduce_op, root, ahead=True)
            return False
        out = call.buffers["out"]
        src = call.buffers["in"] if call.op == "reduce_scatter" else out
        self._settle(call.op, src, call.count, call.dtype, call.reduce_op, root, ahead=False, out=out)
        self.kept = _Kept(call.seq, call.op, call.dtype, call.count, call.reduce_op, src.copy())
        return True

    def _settle(self, op: str, data: np.ndarray, count: int, dtype: str, reduce_op: Any, root: int, *, ahead: bool,
                out: np.ndarray | None = None) -> None:
        """Collective ``low`` on the hosts: its result from ``root`` (allreduce, broadcast), or reduce_scatter
        again with the ring (``data`` is the input)."""
        if op == "reduce_scatter":
            dst = out if out is not None else np.empty(count, data.dtype)
            self.ctx.host.run("reduce_scatter", "ring", {"in": data, "out": dst}, count=count, reduce_op=reduce_op,
                              dtype=dtype)
        else:
            self.ctx.host.broadcast(data if ahead else out, root)  # type: ignore[arg-type]

    # ---- a collective on the node ---------------------------------------------------------------------
    def _elements(self, call: OffloadCall) -> int:
        return max(1, self.s.chunk_bytes // call.buffers["out"].itemsize)

    def _chunks_of(self, call: OffloadCall) -> int:
        per = self._elements(call)
        if call.op == "reduce_scatter":
            return self.ctx.size * -(-call.count // per)
        return -(-call.count // per)

    def _on_node(self, call: OffloadCall, link: Link) -> None:
        out = call.buffers["out"]
        item = out.itemsize
        per = self._elements(call)
        rank, p, n = self.ctx.rank, self.ctx.size, call.count
        scratch = self._scratch_for(n * item)
        redop = 0 if call.reduce_op is None else (  # AVG sums on the node; the core divides afterwards
            ReduceOp.SUM.code if call.reduce_op is ReduceOp.AVG else call.reduce_op.code)
        if call.op == "reduce_scatter":
            src = memoryview(call.buffers["in"]).cast("B")
            chunks = [Chunk(r * n + o, min(per, n - o), src[(r * n + o) * item:(r * n + o + min(per, n - o)) * item],
                            r == rank) for r in range(p) for o in range(0, n, per)]
            origin = rank * n
            total = p * n
        else:
            mine = memoryview(out).cast("B")
            sends = call.op == "allreduce" or call.root == rank
            wants = call.op == "allreduce" or call.root != rank
            chunks = [Chunk(o, min(per, n - o), mine[o * item:(o + min(per, n - o)) * item] if sends else None, wants)
                      for o in range(0, n, per)]
            origin, total = 0, n
        head = H.Header(H.DATA, op=H.OPS[call.op], dtype=dtypes.code_of(call.dtype), redop=redop,
                        job=self.ctx.job, group=self.ctx.group, message=call.seq, total=total,
                        root=H.NO_RANK if call.root is None else call.root)

        def land(i: int, payload: memoryview) -> None:
            c = chunks[i]
            at = (c.offset - origin) * item
            if len(payload) != c.count * item:
                raise NodeError(f"a result of {len(payload)} bytes for {c.count} elements")
            scratch[at:at + len(payload)] = payload

        try:
            window = min(link.granted, max(2, self.s.inflight_bytes // self.s.chunk_bytes))
            link.transfer(head, chunks, self.seq, window, land, call.deadline)
        except NodeError as exc:
            me = self.ctx.ranks[rank]
            raise MismatchError(f"rank {me}: {call.op} (group {self.ctx.group}, seq {call.seq}) via aggregation "
                                f"node {self.s.nodes[self.active or 0]}: {exc}", rank=me, op=call.op) from None
        except TimeoutError as exc:
            me = self.ctx.ranks[rank]
            raise CollectiveTimeoutError(
                f"rank {me}: {call.op} (group {self.ctx.group}, seq {call.seq}) hit its timeout of "
                f"{self.ctx.timeout:.1f}s waiting for aggregation node {self.s.nodes[self.active or 0]}: {exc}",
                rank=me, op=call.op) from None
        self.seq += len(chunks)
        result = scratch.view(out.dtype)[:n] if n else out[:0]
        if call.op == "broadcast" and call.root == rank:
            self.kept = _Kept(call.seq, call.op, call.dtype, n, call.reduce_op, out.copy())
            return
        if call.op == "reduce_scatter":
            out[...] = result
            self.kept = _Kept(call.seq, call.op, call.dtype, n, call.reduce_op, call.buffers["in"].copy())
            return
        out[...] = result
        self.kept = _Kept(call.seq, call.op, call.dtype, n, call.reduce_op, result)
        self._turn ^= 1  # the kept result stays in this scratch; the next collective lands in the other

    def _scratch_for(self, nbytes: int) -> np.ndarray:
        buf = self._scratch[self._turn]
        if buf.nbytes < nbytes:
            buf = self._scratch[self._turn] = np.empty(max(nbytes, 64), np.uint8)
        return buf[:nbytes] if nbytes else buf[:0]

