"""``Op``: one collective's identity on the wire and its limits, as the executor (``executor``) and the
compression side of a run (``compressed_run``) read it."""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from ..errors import CollectiveError
from ..protocol.reduce_ops import ReduceOp
from ..wire import DATA, NO_ROOT


class _OpFields(NamedTuple):
    name: str
    algorithm: str
    opcode: int
    dtype: str
    dtype_code: int
    numel: int
    job: int
    group: int
    label: str  # how errors name the group: "group 3", "group 1 (tp)"
    reduce_op: ReduceOp | None
    root: int  # the root's rank in the group (rooted ops), else wire.NO_ROOT
    timeout: float
    ranks: Sequence[int]
    rank: int
    head: tuple[int, ...]  # the first fields of every DATA header of the op (kind to group), worked out once
    seq: int
    key: Hashable | None
    deadline: float


class Op(_OpFields):
    """One collective's identity on the wire, its limits and, for error feedback, the caller's buffer
    identity (``key``; None: no stable identity). Built with keywords; ``again`` makes the next call's from
    a cached one (a new sequence number, key and deadline) for the price of a tuple."""

    __slots__ = ()

    def __new__(cls, *, name: str, opcode: int, dtype: str, dtype_code: int, numel: int, job: int, group: int,
                seq: int, reduce_op: ReduceOp | None, timeout: float, ranks: Sequence[int],
                rank: int, algorithm: str = "", key: Hashable | None = None, root: int = NO_ROOT,
                label: str = "") -> Op:
        head = (DATA, job, dtype_code, opcode, reduce_op.code if reduce_op else 0, root, group)
        return _new(cls, (name, algorithm, opcode, dtype, dtype_code, numel, job, group, label or f"group {group}",
                          reduce_op, root, timeout, ranks, rank, head, seq, key, time.monotonic() + timeout))

    def again(self, seq: int, key: Hashable | None) -> Op:
        return _new(Op, (*self[:_PER_CALL], seq, key, time.monotonic() + self.timeout))

    def failed(self, exc: CollectiveError) -> CollectiveError:
        """``exc`` (a transport's error) as this op raises it: of the same type, with its fields, the message
        naming the op, its group and sequence number and this rank first."""
        fields: dict[str, Any] = {"rank": self.rank, "op": self.name}
        for name in ("peer", "gone"):  # (PeerLostError's and IntegrityError's; AbortedError's)
            if hasattr(exc, name):
                fields[name] = getattr(exc, name)
        return type(exc)(f"{self.name} ({self.label}, seq {self.seq}) failed on rank {self.rank}: {exc}", **fields)


_new = tuple.__new__
_PER_CALL = _OpFields._fields.index("seq")  # fields from 'seq' on change with every call
