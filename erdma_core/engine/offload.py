"""Offloaded collectives: an algorithm that runs a collective with an endpoint outside the group (an
aggregation node, a switch) instead of a schedule among the ranks.

A plugin registers one with ``register(op, name, factory, offload=True)`` (``erdma_register_algorithms``).
The core calls ``factory(OffloadContext)`` once per process group and factory (register the same factory
for several ops and they share that object, its connections and its state), on the first collective that
selects it, and then ``run(OffloadCall)`` for each collective; ``close()`` when the group is destroyed.

``run`` either completes the collective (the result in ``call.buffers['out']``, before the core's
finishing step: ReduceOp.AVG still divides afterwards, so an offload sums for AVG) and returns None, or
returns ``Fallback(algorithm, reason)``: the core then runs this same collective (same sequence number, same
buffers, untouched) with that host algorithm, logs the reason and counts it (``ProcessGroup.counters``).
Every rank must answer the same for the same collective; ranks agree through ``OffloadContext.host``, a
channel of host collectives among the group's ranks over the group's transport, apart from the
collectives' own sequence numbers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import attrs
import numpy as np

from ..algorithms.schedule import Options
from ..protocol import dtypes
from ..protocol.reduce_ops import ReduceOp
from ..security import auth
from ..transport.base import Transport
from ..wire import CONTROL_GROUP_BIT
from .runner import Runner


@attrs.frozen
class Fallback:
    """``Offload.run``'s answer when the collective must run on the hosts: the host ``algorithm`` (registered
    for the op) and why, for the log and the counters."""

    algorithm: str
    reason: str


class OffloadCall(NamedTuple):
    """One collective handed to an offload. ``buffers``: ``out`` (the result; holds the input for allreduce
    and broadcast) and ``in`` (reduce_scatter's ``size * count`` input); ``count`` as ``Spec.count``;
    ``root``: the group rank of a rooted op, else None; ``deadline``: ``time.monotonic()`` value by which it
    must have finished or raised ``CollectiveTimeoutError``."""

    op: str
    seq: int
    buffers: Mapping[str, np.ndarray]
    dtype: str
    count: int  # type: ignore[assignment]  # (a field, shadowing tuple.count)
    reduce_op: ReduceOp | None
    root: int | None
    deadline: float


class Offload(Protocol):
    def run(self, call: OffloadCall) -> Fallback | None: ...

    def close(self) -> None: ...


class HostChannel:
    """Host collectives among a group's ranks on a sequence of their own (the group id with
    ``CONTROL_GROUP_BIT``): every rank must make the same calls in the same order. Built-in algorithms only
    (an offload must not reach itself)."""

    def __init__(self, *, transport: Transport, algorithm: Callable[[str, str], tuple[Any, Options]], job: int,
                 group: int, ranks: Sequence[int], rank: int, timeout: float, chunk_bytes: int) -> None:
        self._algorithm = algorithm
        self._runner = Runner(transport=transport, algorithm=algorithm, choose=_named, job=job,
                              group=group | CONTROL_GROUP_BIT, ranks=ranks, rank=rank, timeout=timeout,
                              chunk_bytes=chunk_bytes)
        self._size = len(self._runner.ranks)
        self._seq = itertools.count(1)

    def run(self, op: str, algorithm: str, buffers: Mapping[str, np.ndarray], *, count: int,
            reduce_op: ReduceOp | None = None, root: int | None = None, dtype: str | None = None) -> None:
        """Run ``op`` with the host ``algorithm`` on ``buffers`` (``out``, and ``in`` where the op has one) of
        eRDMA dtype ``dtype`` (default: the numpy dtype's; bfloat16 must be named); raises
        ``CollectiveError`` naming the op and the peer as the collectives do."""
        comp, _ = self._algorithm(op, algorithm)
        if comp.plugin != "builtin":
            raise ValueError(f"HostChannel runs built-in algorithms only, not {algorithm!r} of {comp.plugin!r}")
        out = buffers["out"]
        dtype = dtype or dtypes.name_for_numpy(out.dtype)
        fields = {} if root is None else {"root": root}
        compiled = self._runner.compiled((op, algorithm, count, dtype, reduce_op, root), op, count, dtype,
                                         out.itemsize, reduce_op, algorithm, fields)
        seq = next(self._seq)
        self._runner.begin(seq)
        self._runner.run(compiled, {"in": np.empty(0, out.dtype), **buffers}, seq)

    def allgather(self, values: Sequence[int]) -> np.ndarray:
        """Every rank's ``values`` (int64, the same length on every rank): an array of shape (size, len)."""
        mine = np.asarray(values, np.int64)
        out = np.empty(self._size * mine.size, np.int64)
        self.run("allgather", "ring", {"in": mine, "out": out}, count=mine.size)
        return out.reshape(self._size, mine.size)

    def broadcast(self, array: np.ndarray, root: int) -> None:
        """``array`` of group rank ``root`` copied into ``array`` on every rank (same size and dtype)."""
        self.run("broadcast", "tree", {"out": array.reshape(-1)}, count=array.size, root=root)


def _named(op: str, nbytes: int, algorithm: str | None) -> str:
    """A host collective's algorithm: the one it names (never chosen by size)."""
    if algorithm is None:
        raise ValueError(f"HostChannel: {op} must name its algorithm")
    return algorithm


@attrs.frozen
class OffloadContext:
    """What an offload is given once per group: the job, this rank's place in the group (``rank`` is the
    group rank; ``ranks`` the members' global ranks), the collective timeout, its options (the section
    ``[algorithm.<op>.<name>]`` of the op that first selected it; ``config`` is the whole effective config,
    for an offload serving several ops from one section), ``host``, and ``key(purpose)``: a
    32-byte key derived from the job's secret (``security.secret``) and its id, the same on every rank,
    for authenticating this job to an endpoint."""

    job: int
    group: int
    rank: int
    size: int
    ranks: tuple[int, ...]
    timeout: float
    options: Options
    config: Any
    host: HostChannel
    secret: bytes = attrs.field(repr=False)

    def key(self, purpose: bytes) -> bytes:
        return auth.derive(self.secret, b"offload:" + purpose + b":" + self.job.to_bytes(8, "little"))
