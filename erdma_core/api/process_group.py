"""``ProcessGroup``: the collective API, shaped like torch.distributed's.

Calls are validated in the caller's thread (bad input raises at once) and run in issue order (``Serial``): a
blocking call on the caller's own thread when nothing is queued ahead of it, an ``async_op=True`` call on the
group's runner threads (or on the thread that waits for it, if none has started it), which returns the
``Work`` instead of waiting for it.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from ..engine import topology
from ..engine.buffers import Buffer, as_buffer, flat
from ..engine.group_offloads import Offloads
from ..engine.offload import OffloadCall
from ..engine.program import chunk_bytes
from ..engine.runner import Compiled, Runner
from ..engine.runtime import Runtime
from ..errors import AbortedError, ErdmaError, PluginError
from ..protocol import reduce_ops
from ..protocol.reduce_ops import ReduceOp
from .recent import Recent
from .serial import Serial
from .work import Work, bare

_EMPTY = np.empty(0, np.uint8)
_SEQUENCES = (list, tuple)


_CALLS = {"destroyed": "destroy() / destroy_process_group()", "aborted": "abort()"}


class ProcessGroup:
    def __init__(self, rt: Runtime, ranks: Sequence[int], group_id: int) -> None:
        self.rt = rt
        self.ranks = tuple(ranks)
        self.group_id = group_id
        self._rank = self.ranks.index(rt.rank)
        self._seq = itertools.count(1)
        self._p2p: dict[tuple[str, int, int], int] = {}
        self._ended: str | None = None  # "destroyed" or "aborted": every op raises
        self._name = ""
        self._serial = Serial(f"erdma-pg{group_id}")
        # point-to-point: receives are posted at call time and waited for here; sends keep their order
        self._recv_waiters = cf.ThreadPoolExecutor(16, thread_name_prefix=f"erdma-pg{group_id}-rx")
        self._sender = Serial(f"erdma-pg{group_id}-tx")
        self._lock = threading.Lock()
        self._recent_alltoall = Recent()
        self.ring = self._ring()
        self.runner = Runner(transport=rt.transport, algorithm=rt.algorithm, choose=self._algorithm, job=rt.job,
                             group=group_id, ranks=self.ranks, rank=rt.rank, timeout=rt.timeout,
                             chunk_bytes=chunk_bytes(rt.config["collectives.chunk_bytes"], rt.transport.stripes),
                             codecs=rt.codecs.for_op, ring=self.ring)
        self.offloads = Offloads(transport=rt.transport, algorithm=rt.algorithm, job=rt.job, group=group_id,
                                 ranks=self.ranks, rank=rt.rank, timeout=rt.timeout,
                                 chunk_bytes=self.runner.chunk_bytes, config=rt.config,
                                 secret=rt.config["security.secret"].encode())

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.ranks)

    # ---- what the job runs on: for a plugin's diagnostics, labs and tests (collectives never need them) ----
    @property
    def transport(self) -> Any:
        """The job's connected transport: the component ``transport.name`` selected (its own counters, paths
        and statistics are its plugin's to document). Shared by every group of the job."""
        return self.rt.transport

    @property
    def store(self) -> Any:
        """The job's discovery store (``erdma_core.sdk.Store``): what the ranks published at set-up."""
        return self.rt.store

    @property
    def config(self) -> Any:
        """The job's effective config (``erdma_core.sdk.Config``: read it, ``config["key"]``,
        ``config.section("transport.tcp")``)."""
        return self.rt.config

    @property
    def slow_links(self) -> frozenset[frozenset[int]]:
        """Pairs of global ranks whose path goes through a relay, as the job last agreed (``agree_paths``)."""
        return self.rt.slow_links

    @slow_links.setter
    def slow_links(self, pairs: frozenset[frozenset[int]]) -> None:
        """Groups made after this order their rings around ``pairs`` (``frozenset()``: in group order, a
        benchmark's baseline); existing groups keep their order until ``agree_paths``."""
        self.rt.slow_links = frozenset(frozenset(p) for p in pairs)

    @property
    def devices(self) -> frozenset[str]:
        """Device types the transport moves without a host copy (see ``Transport.devices``)."""
        return frozenset(getattr(self.rt.transport, "devices", {"cpu"}))

    def failure(self) -> BaseException | None:
        """What aborted the job's transport (a lost peer, a peer's ABORT): every collective fails with it from
        then on. None while the transport is whole."""
        return self.rt.transport.failure()

    def __repr__(self) -> str:
        return f"ProcessGroup(rank={self._rank}, size={self.size()}, group={self.group_id})"

    # ---- plumbing -------------------------------------------------------------------------------------
    def _submit(self, name: str, fn: Callable[[], Any], async_op: bool, serial: Serial | None = None) -> Work | None:
        serial = serial or self._serial
        if async_op:
            return Work(serial.submit(fn), name, self.rt.rank, serial.help)
        try:
            serial.call(fn)  # raises the op's own error
        except ErdmaError as exc:
            if self._ended is not None:  # destroyed or aborted by another thread after this op was checked
                self._usable(name)
            raise bare(exc) from None
        return None

    def _algorithm(self, op: str, nbytes: int, chosen: str | None) -> str:
        name = chosen or self.rt.config[f"collectives.{op}"]
        if name == "auto":
            name = self.rt.components.pm.hook.erdma_choose_algorithm(
                op=op, nbytes=nbytes, world_size=self.size(), config=self.rt.config)
        return name

    @property
    def name(self) -> str:
        """The group's name in error messages ("" by default: they say "group <id>"). torch's backend gives
        each group torch's own name and description, so that subgroups are told apart."""
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        with self._lock:
            self._name = value
            self.runner.label = self.offloads.label = self.label

    @property
    def label(self) -> str:
        """How errors name this group: "group 2", or "group <name>" once it has a name."""
        return f"group {self._name}" if self._name else f"group {self.group_id}"

    def _usable(self, name: str) -> None:
        """Raise if this group (or the job's transport, with the default group) was destroyed."""
        if self._ended is not None:
            said = (f"rank {self.rt.rank}: {name} on {self.label} after this group was {self._ended} "
                    f"({_CALLS[self._ended]}); make a new group to go on")
            if self._ended == "aborted":
                raise AbortedError(said, rank=self.rt.rank, op=name)
            raise ErdmaError(said)
        if self.rt.closed:
            raise ErdmaError(f"rank {self.rt.rank}: {name} on {self.label} after the job's transport was "
                             "closed (the default group was destroyed or a group aborted); make a new group to go on")

    def _collective(self, name: str, count: int, buffers: dict[str, np.ndarray], dtype: str,
                    reduce_op: ReduceOp | None, after: Callable[[], None] | None, async_op: bool,
                    algorithm: str | None = None, key: Hashable | None = None, **spec_fields: Any) -> Work | None:
        """Plan one collective in the caller's thread (bad input raises here), then run it in issue order."""
        self._usable(name)
        self.rt.codecs.issued(name)
        seq = next(self._seq)
        ckey = (name, count, dtype, reduce_op, algorithm, *spec_fields.values())
        runner = self.runner
        compiled = runner.cached(ckey) or runner.compiled(ckey, name, count, dtype, buffers["out"].itemsize,
                                                          reduce_op, algorithm, spec_fields)
        if compiled.codecs.lossy and key is None:
            key = _memory_key(buffers["out"], dtype)
        if "in" not in buffers:
            buffers["in"] = _EMPTY

        def run() -> None:
            host: Compiled | None = compiled
            if compiled.offload is not None or compiled.op is not None:
                runner.begin(seq)
            if compiled.offload is not None:
                host = self._offloaded(compiled, ckey, name, seq, buffers, dtype, count, reduce_op, spec_fields)
            if host is not None:
                runner.run(host, buffers, seq, key)
            if after is not None:
                after()

        return self._submit(name, run, async_op)

    def _offloaded(self, compiled: Compiled, ckey: tuple[Any, ...], name: str, seq: int,
                   buffers: dict[str, np.ndarray], dtype: str, count: int, reduce_op: ReduceOp | None,
                   spec_fields: dict[str, Any]) -> Compiled | None:
        """Run an offloaded collective; the host program to run instead where the offload fell back."""
        fallback = self.offloads.run(compiled.offload, OffloadCall(
            name, seq, buffers, dtype, count, reduce_op, spec_fields.get("root"), time.monotonic() + self.rt.timeout))
        if fallback is None:
            return None
        host = self.runner.compiled((*ckey, fallback.algorithm), name, count, dtype, buffers["out"].itemsize,
                                    reduce_op, fallback.algorithm, spec_fields)
        if host.offload is not None:
            raise PluginError(f"{name} algorithm {compiled.offload.name!r} fell back to {fallback.algorithm!r}, "
                              "which is not a host algorithm")
        return host

    def counters(self) -> dict[str, int]:
        """How this group's collectives ran through offloaded algorithms: ``<op>.<algorithm>.offloaded``,
        ``<op>.<algorithm>.fallback`` and ``<op>.<algorithm>.fallback.<host algorithm>``, and what an offload's
        own ``counters()`` (optional) reports, as ``<algorithm>.<name>``. With a compressor configured, what it
        did with this rank's messages (every group's): ``compression.<name>.encoded.messages``,
        ``.encoded.raw_bytes`` and ``.encoded.wire_bytes``, and, for messages sent raw, ``.small.*`` (under
        ``compression.min_bytes``), ``.skipped.*`` (``compression.policy = "auto"``), ``.declined.*`` (by the
        codec), each as ``messages`` and ``raw_bytes``. With ``transport.fallback`` set: how many peers each
        transport carries, ``transport.<name>.peers``, and ``transport.relayed.peers`` (``paths()`` says which)."""
        out = self.offloads.counters()
        counted = getattr(self.rt.transport, "counters", None)
        if callable(counted):
            out.update(counted())
        sender = self.rt.codecs.sender
        if sender is not None:
            out.update({f"compression.{sender.name}.{k}": v for k, v in self.rt.codecs.stats().items()})
        return out

    def paths(self) -> dict[int, str]:
        """How this rank reaches each other rank of the job, where the transport says (a traversal with
        candidates): ``HOST:PORT direct`` or ``relayed``, and with ``transport.fallback`` the transport's name
        after it; empty when it does not."""
        return dict(getattr(self.rt.transport, "paths", dict)())

    def slow_peers(self) -> set[int]:
        """The ranks this rank's transport reaches through a relay now (empty when none, or it cannot say)."""
        found = getattr(self.rt.transport, "slow_peers", None)
        return set((found() if callable(found) else None) or ())

    def agree_paths(self) -> bool:
        """Agree again with every rank on the job's slow links (pairs whose transport goes through a relay
        now: a relayed path that moved to a direct one, or back) and run this group's later ring allreduces in
        an order with as few of them between neighbours as there can be. Collective over the whole job: every
        rank calls it on the default group at the same point, with no op of the job under way (an elastic group
        does, at the step boundary after a member's paths changed). Returns whether the ring order changed."""
        if self.group_id != 0:
            raise ErdmaError(f"rank {self.rt.rank}: agree_paths() is called on the default group (the whole job); "
                             f"this is group {self.group_id}")
        self.rt.paths_round += 1
        self.rt.slow_links = topology.agree(self.rt.store, self.rt.rank, self.rt.world_size, self.slow_peers(),
                                            self.rt.config["timeouts.connect"], self.rt.paths_round)
        ring = self._ring()
        if ring == self.ring:
            return False
        self.ring = ring
        self.runner.reorder(ring)
        return True

    def _ring(self) -> tuple[int, ...]:
        """The order (global ranks) a ring allreduce runs through the group's ranks: as few slow links between
        neighbours as there can be; the group's own order when none is slow."""
        local = frozenset(frozenset(self.ranks.index(r) for r in pair) for pair in self.rt.slow_links
                          if all(r in self.ranks for r in pair))
        return tuple(self.ranks[i] for i in topology.ring_order(len(self.ranks), local))

    def _root(self, root: int, what: str) -> int:
        if not 0 <= root < self.size():
            raise ValueError(f"{what}={root} is not a rank of this group (size {self.size()})")
        return root

    # ---- collectives ----------------------------------------------------------------------------------
    # ``key`` (reductions): names the buffer for a lossy compressor's error feedback, which keeps a residual
    # per buffer and step; by default the buffer's memory (address, bytes, dtype) names it.
    def allreduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False,
                  algorithm: str | None = None, key: Hashable | None = None) -> Work | None:
        """Reduce ``tensor`` across the group in place. ``algorithm`` overrides the config for this call."""
        buf, rop = as_buffer(tensor), reduce_ops.parse(op)
        reduce_ops.check(rop, buf.dtype)

        def after() -> None:
            reduce_ops.finish(buf.array, rop, buf.dtype, self.size())
            buf.commit()

        needed = reduce_ops.needs_finish(rop) or buf.copied
        return self._collective("allreduce", buf.array.size, {"out": buf.array}, buf.dtype, rop,
                                after if needed else None, async_op,
                                algorithm, key)

    def broadcast(self, tensor: Any, src: int = 0, async_op: bool = False) -> Work | None:
        buf = as_buffer(tensor)
        return self._collective("broadcast", buf.array.size, {"out": buf.array}, buf.dtype, None, buf.write_back,
                                async_op, root=self._root(src, "src"))

    def reduce(self, tensor: Any, dst: int = 0, op: ReduceOp | str = ReduceOp.SUM,
               async_op: bool = False, key: Hashable | None = None) -> Work | None:
        buf, rop = as_buffer(tensor), reduce_ops.parse(op)
        reduce_ops.check(rop, buf.dtype)
        root = self._root(dst, "dst")
        result = buf.array.copy()  # only the root's tensor changes

        def after() -> None:
            if self._rank == root:
                reduce_ops.finish(result, rop, buf.dtype, self.size())
                buf.array[...] = result
                buf.commit()

        if key is None and self.rt.codecs.lossy:
            key = _memory_key(buf.array, buf.dtype)
        return self._collective("reduce", result.size, {"out": result}, buf.dtype, rop, after, async_op, key=key,
                                root=root)

    def allgather(self, output: Any, input: Any, async_op: bool = False) -> Work | None:
        src = as_buffer(input, "input", writable=False)
        out, done = self._gathered(output, src, "output")
        return self._collective("allgather", src.array.size, {"in": src.array, "out": out}, src.dtype, None, done,
                                async_op)

    def gather(self, input: Any, gather_list: Any = None, dst: int = 0, async_op: bool = False) -> Work | None:
        src = as_buffer(input, "input", writable=False)
        root = self._root(dst, "dst")
        if self._rank == root:
            if gather_list is None:
                raise ValueError(f"gather: rank {self._rank} is dst and needs gather_list")
            out, done = self._gathered(gather_list, src, "gather_list")
        else:
            out, done = np.empty(0, src.array.dtype), _nothing
        return self._collective("gather", src.array.size, {"in": src.array, "out": out}, src.dtype, None, done,
                                async_op, root=root)

    def scatter(self, output: Any, scatter_list: Any = None, src: int = 0, async_op: bool = False) -> Work | None:
        dst = as_buffer(output, "output")
        root = self._root(src, "src")
        if self._rank == root:
            if scatter_list is None:
                raise ValueError(f"scatter: rank {self._rank} is src and needs scatter_list")
            inp = self._joined(scatter_list, dst, "scatter_list")
        else:
            inp = np.empty(0, dst.array.dtype)
        return self._collective("scatter", dst.array.size, {"in": inp, "out": dst.array}, dst.dtype, None,
                                dst.write_back, async_op, root=root)

    def reduce_scatter(self, output: Any, input: Any, op: ReduceOp | str = ReduceOp.SUM,
                       async_op: bool = False, key: Hashable | None = None) -> Work | None:
        dst, rop = as_buffer(output, "output"), reduce_ops.parse(op)
        reduce_ops.check(rop, dst.dtype)
        inp = self._joined(input, dst, "input")

        def after() -> None:
            reduce_ops.finish(dst.array, rop, dst.dtype, self.size())
            dst.commit()

        if key is None and self.rt.codecs.lossy:
            key = _memory_key(inp, dst.dtype)
        return self._collective("reduce_scatter", dst.array.size, {"in": inp, "out": dst.array}, dst.dtype, rop,
                                after, async_op, key=key)

    def alltoall(self, output: Any, input: Any, output_split_sizes: Sequence[int] | None = None,
                 input_split_sizes: Sequence[int] | None = None, async_op: bool = False,
                 algorithm: str | None = None) -> Work | None:
        """all_to_all_single: split ``input`` along dim 0 by ``input_split_sizes`` (equal when None), send
        piece q to rank q; ``output`` receives rank q's piece at its place by ``output_split_sizes``."""
        if isinstance(output, _SEQUENCES):
            return self._alltoall_lists(output, input, async_op, algorithm)
        key = (None if output_split_sizes is None else tuple(output_split_sizes),
               None if input_split_sizes is None else tuple(input_split_sizes), algorithm)
        known = self._recent_alltoall.get(output, input, key)  # the same arrays as last time: worked out then
        if known is not None:
            dtype, send, recv = known
            return self._collective("alltoall", 0, {"in": flat(input, dtype), "out": flat(output, dtype)}, dtype,
                                    None, None, async_op, algorithm, send_counts=send, recv_counts=recv)
        src, dst = as_buffer(input, "input", writable=False), as_buffer(output, "output")
        _same_dtype(src, dst, "alltoall")
        send = self._splits(input, src, input_split_sizes, "input_split_sizes")
        recv = self._splits(output, dst, output_split_sizes, "output_split_sizes")
        inp = src.array.copy() if np.shares_memory(src.array, dst.array) else src.array
        if inp is src.array and not src.copied and not dst.copied:
            self._recent_alltoall.put(output, input, key, (dst.dtype, send, recv))
        return self._collective("alltoall", 0, {"in": inp, "out": dst.array}, dst.dtype, None, dst.write_back,
                                async_op, algorithm, send_counts=send, recv_counts=recv)

    def _alltoall_lists(self, outputs: Sequence[Any], inputs: Sequence[Any], async_op: bool,
                        algorithm: str | None) -> Work | None:
        if len(outputs) != self.size() or len(inputs) != self.size():
            raise ValueError(f"alltoall: need {self.size()} input and output tensors, got {len(inputs)} "
                             f"and {len(outputs)}")
        outs = [as_buffer(o, f"output[{i}]") for i, o in enumerate(outputs)]
        ins = [as_buffer(t, f"input[{i}]", writable=False) for i, t in enumerate(inputs)]
        for b in outs + ins:
            _same_dtype(ins[0], b, "alltoall")
        flat_out = np.empty(sum(b.array.size for b in outs), outs[0].array.dtype)

        def after() -> None:
            _unpack(flat_out, outs)

        return self._collective("alltoall", 0, {"in": np.concatenate([b.array for b in ins]), "out": flat_out},
                                ins[0].dtype, None, after, async_op, algorithm,
                                send_counts=tuple(b.array.size for b in ins),
                                recv_counts=tuple(b.array.size for b in outs))

    def barrier(self, async_op: bool = False) -> Work | None:
        return self._collective("barrier", 0, {"out": np.empty(0, np.uint8)}, "uint8", None, _nothing, async_op)

    # ---- point to point -------------------------------------------------------------------------------
    def send(self, tensor: Any, dst: int, tag: int = 0, async_op: bool = False) -> Work | None:
        buf = as_buffer(tensor, writable=False)
        return self._p2p_op("send", buf, self._root(dst, "dst"), tag, async_op)

    def recv(self, tensor: Any, src: int, tag: int = 0, async_op: bool = False) -> Work | None:
        buf = as_buffer(tensor)
        return self._p2p_op("recv", buf, self._root(src, "src"), tag, async_op)

    def isend(self, tensor: Any, dst: int, tag: int = 0) -> Work:
        return self.send(tensor, dst, tag, async_op=True)  # type: ignore[return-value]

    def irecv(self, tensor: Any, src: int, tag: int = 0) -> Work:
        return self.recv(tensor, src, tag, async_op=True)  # type: ignore[return-value]

    def _p2p_op(self, kind: str, buf: Buffer, peer: int, tag: int, async_op: bool) -> Work | None:
        self._usable(kind)
        if peer == self._rank:
            raise ValueError(f"{kind}: rank {peer} is this rank; send/recv need another rank")
        if not 0 <= tag < 2**63:
            raise ValueError(f"{kind}: tag {tag} must be in [0, 2**63)")
        key = (kind, peer, tag)
        with self._lock:
            n = self._p2p.get(key, 0)
            self._p2p[key] = n + 1
        done = self.runner.p2p(kind, buf.array, buf.dtype, peer, tag, n)
        if kind == "recv":
            def wait_recv() -> None:
                done()
                buf.commit()

            if not async_op:
                try:
                    wait_recv()
                except ErdmaError as exc:
                    raise bare(exc) from None
                return None
            return Work(self._recv_waiters.submit(wait_recv), kind, self.rt.rank)

        return self._submit(kind, done, async_op, self._sender)

    # ---- groups and shutdown -----------------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int] | None = None) -> ProcessGroup | None:
        """Collective over the whole job: every rank calls it with the same global ``ranks``.
        Returns the new group on its members and None elsewhere."""
        members = sorted(set(range(self.rt.world_size) if ranks is None else ranks))
        if not members or members[0] < 0 or members[-1] >= self.rt.world_size:
            raise ValueError(f"new_group: ranks {list(ranks or [])} must be ranks of the job (0..{self.rt.world_size - 1})")
        gid = self.rt.next_group_id()
        return ProcessGroup(self.rt, members, gid) if self.rt.rank in members else None

    def destroy(self) -> None:
        """Finish queued work and release the group; destroying the default group ends the job's transport.
        Any op on the group afterwards raises ``ErdmaError``."""
        self._ended = self._ended or "destroyed"
        self._release()
        if self.group_id == 0:
            self.rt.close()

    def abort(self, *, gone: Sequence[int] = (), why: str = "") -> None:
        """Tear the group down now, without waiting on peers (torch's ``abort()``; torchft reconfigures this
        way). Every op queued or running on the job's transport fails with ``AbortedError``, the peers are told
        (their ops fail naming this rank: AbortedError, or PeerLostError where the closed connection overtakes
        the word), and the threads and connections are released before this returns.
        As a failure does, it ends the job's transport: every group on it, subgroups included.

        ``gone``: ranks of this group the caller believes are gone (an elastic member whose signs of life
        lapsed; ``why`` says how it knows). The error names them (``AbortedError.gone``, global ranks), no word
        goes to them, and no close waits on their acknowledgements (a QUIC close otherwise waits up to 2 s for
        them); the first of them rides in the word, so the peers' closes skip it too. Still an abort, not a
        loss the transport saw: nothing here counts them out."""
        if self._ended is not None and self.rt.closed:
            return
        bad = [r for r in gone if not 0 <= r < self.size()]
        if bad:
            raise ValueError(f"abort(gone={list(gone)!r}): {bad[0]!r} is not a rank of {self.label} "
                             f"(0..{self.size() - 1})")
        self._ended = "aborted"
        rank = self.rt.rank
        said = f"rank {rank}: {self.label} was aborted by the caller"
        if gone:
            said += f": {', '.join(f'rank {r}' for r in gone)} {'is' if len(gone) == 1 else 'are'} gone"
            said += f" ({why})" if why else ""
        else:
            said += " (ProcessGroup.abort())"
        self.rt.abort(AbortedError(said, gone=tuple(self.ranks[r] for r in gone), rank=rank))
        self._release()

    def _release(self) -> None:
        """Finish (or, after an abort, fail at once) what is queued; stop the group's threads and offloads."""
        self._serial.shutdown()
        self._sender.shutdown()
        self._recv_waiters.shutdown(wait=True)
        self.offloads.close()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # ---- helpers ------------------------------------------------------------------------------------------
    def _gathered(self, output: Any, src: Buffer, what: str) -> tuple[np.ndarray, Callable[[], None] | None]:
        """A flat array of size*n to gather into, and the write-back to the user's output."""
        p, n = self.size(), src.array.size
        if isinstance(output, list | tuple):
            outs = self._parts(output, src, what, writable=True, other="input")
            flat = np.empty(p * n, src.array.dtype)
            return flat, lambda: _unpack(flat, outs)
        dst = as_buffer(output, what)
        _same_dtype(src, dst, what)
        if dst.array.size != p * n:
            raise ValueError(f"{what} has {dst.array.size} elements; world size {p} x input {n} = {p * n}")
        return dst.array, dst.write_back

    def _parts(self, items: Sequence[Any], ref: Buffer, what: str, *, writable: bool, other: str) -> list[Buffer]:
        """One tensor per rank, each of ``ref``'s dtype and element count."""
        p, n = self.size(), ref.array.size
        if len(items) != p:
            raise ValueError(f"{what}: need {p} tensors, got {len(items)}")
        bufs = [as_buffer(t, f"{what}[{i}]", writable=writable) for i, t in enumerate(items)]
        for i, b in enumerate(bufs):
            _same_dtype(ref, b, what)
            if b.array.size != n:
                raise ValueError(f"{what}[{i}] has {b.array.size} elements, the {other} {n}")
        return bufs

    def _joined(self, inputs: Any, dst: Buffer, what: str) -> np.ndarray:
        p, n = self.size(), dst.array.size
        if isinstance(inputs, list | tuple):
            parts = self._parts(inputs, dst, what, writable=False, other="output")
            return np.concatenate([b.array for b in parts])
        src = as_buffer(inputs, what, writable=False)
        _same_dtype(dst, src, what)
        if src.array.size != p * n:
            raise ValueError(f"{what} has {src.array.size} elements; world size {p} x output {n} = {p * n}")
        return src.array

    def _splits(self, tensor: Any, buf: Buffer, sizes: Sequence[int] | None, what: str) -> tuple[int, ...]:
        shape = tuple(getattr(tensor, "shape", (buf.array.size,))) or (1,)
        rows, per_row = shape[0], buf.array.size // max(1, shape[0])
        p = self.size()
        if sizes is None:
            if rows % p:
                raise ValueError(f"alltoall: dim 0 of size {rows} is not divisible by the world size {p}; "
                                 f"pass {what}")
            return tuple([rows // p * per_row] * p)
        sizes = list(sizes)
        if len(sizes) != p or sum(sizes) != rows or min(sizes) < 0:
            raise ValueError(f"alltoall: {what}={sizes} must be {p} non-negative sizes summing to dim 0 ({rows})")
        return tuple(s * per_row for s in sizes)


def _nothing() -> None:
    pass


def _memory_key(arr: np.ndarray, dtype: str) -> Hashable:
    """A buffer's identity for error feedback: its memory (address and size) and dtype."""
    return ("memory", arr.__array_interface__["data"][0], arr.nbytes, dtype)


def _same_dtype(a: Buffer, b: Buffer, what: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{what}: dtype {b.dtype} does not match the input's {a.dtype}")


def _unpack(flat: np.ndarray, outs: Sequence[Buffer]) -> None:
    pos = 0
    for b in outs:
        b.array[...] = flat[pos:pos + b.array.size]
        pos += b.array.size
        b.commit()
