"""The one table of operations: every op's wire code, its built-in default algorithm, whether it reduces,
its buffers' sizes and its bus-bandwidth factor. Config keys, wire codes, the algorithm chooser, the
schedule checker and the benchmarks all read it; nothing else lists the ops.

Wire codes are written down here and never renumbered (``tests/test_wire.py`` pins them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs


class Spec(Protocol):
    """What the table reads of a collective's description (``algorithms.schedule.Spec`` is one)."""

    @property
    def op(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def count(self) -> int: ...

    @property
    def root(self) -> int: ...


def _whole(spec: Spec) -> tuple[int, int]:
    return 0, spec.count


@attrs.frozen(kw_only=True)
class OpInfo:
    """``sizes(spec) -> (in, out)``: elements of the ``in`` and ``out`` buffers on ``spec.rank``; the
    ``work`` scratch buffer has as many as the larger of the two. ``bus_factor(p)`` converts algorithm
    bandwidth to bus bandwidth as nccl-tests does (None: not benchmarked)."""

    name: str
    code: int
    default: str | None = None
    reduces: bool = False
    sizes: Callable[[Spec], tuple[int, int]] = _whole
    bus_factor: Callable[[int], float] | None = None


def _gather(spec: Spec) -> tuple[int, int]:
    return spec.count, spec.count * spec.size if spec.rank == spec.root else 0


def _scatter(spec: Spec) -> tuple[int, int]:
    return spec.count * spec.size if spec.rank == spec.root else 0, spec.count


OPS: dict[str, OpInfo] = {op.name: op for op in (
    OpInfo(name="allreduce", code=1, default="ring", reduces=True, bus_factor=lambda p: 2 * (p - 1) / p),
    OpInfo(name="broadcast", code=2, default="tree", bus_factor=lambda p: 1.0),
    OpInfo(name="reduce", code=3, default="tree", reduces=True),
    OpInfo(name="allgather", code=4, default="ring", sizes=lambda s: (s.count, s.count * s.size),
           bus_factor=lambda p: (p - 1) / p),
    OpInfo(name="gather", code=5, default="direct", sizes=_gather),
    OpInfo(name="scatter", code=6, default="direct", sizes=_scatter),
    OpInfo(name="reduce_scatter", code=7, default="ring", reduces=True, sizes=lambda s: (s.count * s.size, s.count),
           bus_factor=lambda p: (p - 1) / p),
    OpInfo(name="alltoall", code=8, default="pairwise", sizes=lambda s: (sum(s.send_counts), sum(s.recv_counts)),  # type: ignore[attr-defined]
           bus_factor=lambda p: (p - 1) / p),
    OpInfo(name="barrier", code=9, default="dissemination", sizes=lambda s: (0, 0)),
    OpInfo(name="send", code=10),  # point to point (send/recv): no algorithm
)}
COLLECTIVES: tuple[str, ...] = tuple(name for name, op in OPS.items() if op.default is not None)
OFFLOADABLE = ("allreduce", "broadcast", "reduce_scatter")  # ops an offloaded algorithm may implement
BENCHMARKED: dict[str, Callable[[int], float]] = {n: op.bus_factor for n, op in OPS.items() if op.bus_factor}
_BY_CODE = {op.code: name for name, op in OPS.items()}


def name_of(code: int) -> str:
    return _BY_CODE.get(code, f"op#{code}")


def buffer_sizes(spec: Spec) -> dict[str, int]:
    """Elements of each buffer a schedule for ``spec`` may name."""
    n_in, n_out = OPS[spec.op].sizes(spec)
    return {"in": n_in, "out": n_out, "work": max(n_in, n_out)}
