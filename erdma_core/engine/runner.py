"""``Runner``: one group's collectives from their description to the bytes moved. The algorithm is chosen
(``choose``), its schedule planned and checked, compiled for the group's ranks and cached per (op, size,
dtype, ...); each call then runs the cached program over the transport with the group's scratch memory.
``ProcessGroup`` and the offloads' ``HostChannel`` each run theirs through one."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..algorithms.schedule import Options, Spec
from ..errors import ConfigError, PluginError
from ..protocol import dtypes
from ..protocol.ops import OPS, buffer_sizes
from ..protocol.reduce_ops import ReduceOp
from ..transport.base import Transport
from ..transport.mailbox import as_bytes
from ..wire import DATA, NO_ROOT, P2P_GROUP_BIT, Header
from . import executor
from .buffers import page_aligned
from .codec_set import NO_CODECS, Codecs
from .compressed_run import decode
from .plans import plan
from .program import Program, compile_plan

_CACHED = 1024  # compiled collectives a runner keeps (a job that makes more starts the cache again)


class Compiled(NamedTuple):
    program: Program
    op: executor.Op | None  # the op's fields every call shares (None: no steps to run, as in most ops of a group of one)
    work: int | None  # elements of the 'work' buffer (None: the schedule does not use one)
    codecs: Codecs  # the codecs for this op
    offload: Any = None  # the registered offload algorithm (``engine.offload``): no program of its own


class Runner:
    """Compiles, caches and runs one group's collectives. ``algorithm(op, name)`` gives a registered
    algorithm's component and options; ``choose(op, nbytes, name)`` the name to use for a call that names
    ``name`` (None: the configured one, or what ``auto`` picks); ``codecs(op)`` the codecs for an op (None:
    every message raw); ``ring``, the order of the group's global ranks a ring allreduce runs in."""

    def __init__(self, *, transport: Transport, algorithm: Callable[[str, str], tuple[Any, Options]],
                 choose: Callable[[str, int, str | None], str], job: int, group: int, ranks: Sequence[int], rank: int,
                 timeout: float, chunk_bytes: int, codecs: Callable[[str], Codecs] | None = None,
                 ring: Sequence[int] | None = None) -> None:
        self.transport, self.job, self.group, self.rank = transport, job, group, rank
        self.ranks = tuple(ranks)
        self.ring = tuple(ring or ranks)
        self.timeout, self.chunk_bytes = timeout, chunk_bytes
        self._algorithm, self._choose = algorithm, choose
        self._codecs = codecs or (lambda op: NO_CODECS)
        self._label = ""
        self._plans: dict[Hashable, Compiled] = {}
        # scratch (one collective of the group at a time uses it, on whichever thread runs it): slots 0 and 1 for
        # reducing receives, 2 for a schedule's 'work' buffer
        self._arenas = [np.empty(0, np.uint8) for _ in range(3)]
        self._views: dict[tuple[int, int, np.dtype], np.ndarray] = {}  # (slot, count, dtype) -> view of an arena

    @property
    def label(self) -> str:
        """How the ops' errors name the group ("" : "group <id>")."""
        return self._label

    @label.setter
    def label(self, value: str) -> None:
        self._label = value
        self._plans.clear()  # their ops carry the label

    def reorder(self, ring: Sequence[int]) -> None:
        """Run later ring allreduces in ``ring``'s order (every rank switches at the same collective)."""
        self.ring = tuple(ring)
        self._plans.clear()

    def cached(self, key: Hashable) -> Compiled | None:
        """The collective compiled under ``key``, if it was."""
        return self._plans.get(key)

    def compiled(self, key: Hashable, name: str, count: int, dtype: str, itemsize: int, reduce_op: ReduceOp | None,
                 algorithm: str | None, spec_fields: Mapping[str, Any]) -> Compiled:
        """The collective compiled under ``key``, compiling it first if it was not (``spec_fields``: ``root``,
        ``send_counts``, ``recv_counts``, as the op has them)."""
        found = self._plans.get(key)
        if found is None:
            found = self._compile(name, count, dtype, itemsize, reduce_op, algorithm, spec_fields)
            if len(self._plans) >= _CACHED:
                self._plans.clear()
            self._plans[key] = found
        return found

    def _compile(self, name: str, count: int, dtype: str, itemsize: int, reduce_op: ReduceOp | None,
                 algorithm: str | None, spec_fields: Mapping[str, Any]) -> Compiled:
        local = sum(spec_fields["send_counts"]) if name == "alltoall" else count  # alltoall's count is 0
        algo = self._choose(name, local * itemsize, algorithm)
        component, options = self._algorithm(name, algo)
        codecs = self._codecs(name)
        if component.offload:
            if codecs.sender is not None:  # an offload moves the caller's elements as they are
                raise ConfigError(f"{name} algorithm {algo!r} runs through an offload (plugin {component.plugin!r}), "
                                  f"which compression.name={codecs.sender.name!r} cannot apply to; leave {name} out "
                                  "of compression.ops or choose another algorithm")
            return Compiled(Program((), False), None, None, codecs, component)
        # any member may stand anywhere in an allreduce ring (each ends with the same sum)
        ranks = self.ring if name == "allreduce" and algo == "ring" else self.ranks
        spec = Spec(name, ranks.index(self.rank), len(ranks), count, options=options, **spec_fields)
        try:
            checked = plan(component, spec)
        except PluginError as exc:
            self.transport.abort(exc)  # the peers would otherwise wait for this rank until their timeout
            raise
        program = compile_plan(checked, ranks, max(1, self.chunk_bytes // itemsize), itemsize, elide=not codecs.lossy)
        op = None
        if program.stages:  # a group of one still runs its local copies (allgather, alltoall, ...)
            op = executor.Op(name=name, algorithm=algo, opcode=OPS[name].code, dtype=dtype,
                             dtype_code=dtypes.code_of(dtype), numel=count, job=self.job, group=self.group, seq=0,
                             reduce_op=reduce_op, timeout=self.timeout, ranks=ranks, rank=self.rank,
                             root=spec_fields.get("root", NO_ROOT), label=self._label)
        return Compiled(program, op, buffer_sizes(spec)["work"] if program.uses_work else None, codecs)

    def begin(self, seq: int) -> None:
        """Tell the transport the group's collective ``seq`` starts (frames for it may be matched)."""
        self.transport.begin(self.group, seq)

    def run(self, compiled: Compiled, buffers: dict[str, np.ndarray], seq: int, key: Hashable | None = None) -> None:
        """Run ``compiled`` (a host program) as the group's collective ``seq`` on ``buffers`` (``in``, ``out``;
        ``work`` is lent from the scratch memory); ``key`` names the buffer for error feedback."""
        if compiled.op is None:
            return
        if compiled.work is not None:
            buffers["work"] = self.scratch(compiled.work, buffers["out"].dtype, 2)
        executor.run(compiled.program, buffers, self.transport, compiled.op.again(seq, key), self.scratch,
                     compiled.codecs)

    def p2p(self, kind: str, array: np.ndarray, dtype: str, peer: int, tag: int, n: int) -> Callable[[], None]:
        """A ``send`` or ``recv`` of ``array`` with group rank ``peer``, the ``n``-th on this ``tag`` between the
        two: a receive is posted now (it matches sends in any order); the call returned completes it (for a
        send: makes it and waits for it), raising a CollectiveError that names the peer."""
        code = OPS["send"].code
        header = Header(kind=DATA, job=self.job, dtype=dtypes.code_of(dtype), opcode=code,
                        group=self.group | P2P_GROUP_BIT, seq=tag, tag=n, numel=array.size, count=array.size,
                        nbytes=array.nbytes)
        op = executor.Op(name=kind, opcode=code, dtype=dtype, dtype_code=header.dtype, numel=array.size, job=self.job,
                         group=self.group, seq=tag, reduce_op=None, timeout=self.timeout, ranks=self.ranks,
                         rank=self.rank, label=self._label)
        t, to = self.transport, self.ranks[peer]
        if kind == "send":
            return lambda: executor.finish(t.isend(to, header, as_bytes(array), op.deadline), peer, op, t, "sending to")
        req = t.irecv(to, header, as_bytes(array))

        def received() -> None:
            executor.finish(req, peer, op, t, "waiting for")
            if req.encoded is not None:
                decode(self._codecs(kind), *req.encoded, array, op, t, peer)

        return received

    def scratch(self, count: int, dtype: np.dtype, slot: int) -> np.ndarray:
        """``count`` elements of ``dtype`` of scratch slot ``slot``, valid until the slot grows."""
        key = (slot, count, dtype)
        view = self._views.get(key)
        if view is None:
            nbytes = count * dtype.itemsize
            if self._arenas[slot].nbytes < nbytes:
                self._arenas[slot] = page_aligned(nbytes)
                self._views.clear()  # views of the old arena
            if len(self._views) >= 64:
                self._views.clear()
            view = self._views[key] = self._arenas[slot][:nbytes].view(dtype)
        return view
