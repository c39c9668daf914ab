"""Algorithms for the tests, installed as a plugin distribution by ``install_plugin("testalgos", ...)``.

* allreduce ``naive_doubling``: each step sends ``out`` to the partner and reduces the partner's ``out``
  into ``out``: plausible, and wrong (the executor may reduce a landed receive into elements a send still
  reads). The core refuses it.
* allreduce ``doubling``: the same through the ``work`` buffer (copy out to work, send work, reduce into
  out): right. Power-of-two worlds only.
* allreduce ``shards``: the parameter server with an option of its own (``[algorithm.allreduce.shards] k``).
"""

from __future__ import annotations

from typing import Any

from erdma_core import hookimpl
from erdma_core.algorithms import parameter_server
from erdma_core.algorithms.schedule import Copy, Options, Spec, Step, Xfer
from erdma_core.config import Option


def naive_doubling(spec: Spec) -> list[Step]:
    steps, d = [], 1
    while d < spec.size:
        peer = spec.rank ^ d
        steps.append(Step(sends=(Xfer(peer, "out", 0, spec.count),),
                          recvs=(Xfer(peer, "out", 0, spec.count, reduce=True),)))
        d <<= 1
    return steps


def doubling(spec: Spec) -> list[Step]:
    if spec.size & (spec.size - 1):
        raise ValueError(f"doubling needs a power-of-two world, got {spec.size}")
    steps, d, n = [], 1, spec.count
    while d < spec.size:
        peer = spec.rank ^ d
        steps.append(Step(copies=(Copy("out", 0, "work", 0, n),), sends=(Xfer(peer, "work", 0, n),),
                          recvs=(Xfer(peer, "out", 0, n, reduce=True),)))
        d <<= 1
    return steps


def shards(spec: Spec) -> list[Step]:
    return parameter_server.allreduce(Spec(spec.op, spec.rank, spec.size, spec.count,
                                           options=Options.of({"servers": spec.options["k"]})))


@hookimpl
def erdma_register_algorithms(register: Any) -> None:
    register("allreduce", "naive_doubling", naive_doubling)
    register("allreduce", "doubling", doubling, description="recursive doubling through 'work'")
    register("allreduce", "shards", shards, options={"k": Option(int, 2, "shard servers", minimum=1)})
