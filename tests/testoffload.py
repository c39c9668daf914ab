"""An offloaded algorithm for the tests, installed as a plugin by ``install_plugin("testoffload", ...)``:
allreduce ``host_sum`` gathers every rank's input over the host channel (``OffloadContext.host``) and sums
in rank order, as an aggregation node would; odd element counts fall back to the ring. Option ``fail_rank``:
that rank raises instead (a plugin's failure). ``bad_answer`` returns something that is not a Fallback."""

from __future__ import annotations

from typing import Any

import numpy as np

from erdma_core import hookimpl
from erdma_core.config import Option
from erdma_core.engine.offload import Fallback, OffloadCall, OffloadContext
from erdma_core.errors import MismatchError


class HostSum:
    def __init__(self, ctx: OffloadContext) -> None:
        self.ctx = ctx
        self.calls = 0

    def run(self, call: OffloadCall) -> Fallback | None:
        self.calls += 1
        if call.count % 2:
            return Fallback("ring", f"odd count {call.count}")
        if self.ctx.rank == self.ctx.options["fail_rank"]:
            raise MismatchError(f"rank {self.ctx.rank}: host_sum refuses", rank=self.ctx.rank, op=call.op)
        out = call.buffers["out"]
        every = np.empty(self.ctx.size * out.size, out.dtype)
        self.ctx.host.run("allgather", "ring", {"in": out.copy(), "out": every}, count=out.size)
        parts = every.reshape(self.ctx.size, out.size)
        acc = parts[0].copy()
        for part in parts[1:]:
            acc += part
        out[...] = acc
        return None

    def counters(self) -> dict[str, int]:
        return {"calls": self.calls, "key_bytes": len(self.ctx.key(b"test"))}

    def close(self) -> None:
        pass


class BadAnswer(HostSum):
    def run(self, call: OffloadCall) -> Any:
        return "ring"


@hookimpl
def erdma_register_algorithms(register: Any) -> None:
    register("allreduce", "host_sum", HostSum, offload=True,
             options={"fail_rank": Option(int, -1, "this rank raises", minimum=-1)})
    register("allreduce", "bad_answer", BadAnswer, offload=True)
