"""Offloaded algorithms (``erdma_core.engine.offload``): an algorithm that runs a collective itself, with
the host channel among the group's ranks and a Fallback to a host algorithm, registered through the same
hook as schedules."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pluggy
import pytest

from erdma_core.errors import CollectiveError, PluginError
from erdma_core.plugins import hookspecs
from erdma_core.plugins.manager import Components, _collect
from erdma_core.testing.world import RankFailure, World


def sums(pg: Any, algorithm: str) -> Any:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("erdma.collectives").addHandler(handler)
    out = []
    for n in (4, 7, 1000, 7):
        x = np.arange(n, dtype=np.float64) * (pg.rank() + 1) + 0.1
        pg.allreduce(x, algorithm=algorithm)
        out.append(x)
    return out, pg.counters(), records


def test_offload_runs_and_falls_back(install_plugin: Any) -> None:
    install_plugin("testoffload", "testoffload")
    with World(3) as w:
        results = w.run(sums, "host_sum")
    for rank, (out, counters, log) in enumerate(results):
        for x, n in zip(out, (4, 7, 1000, 7), strict=True):
            parts = [np.arange(n, dtype=np.float64) * (q + 1) + 0.1 for q in range(3)]
            if n % 2 == 0:  # the offload's rank-order sum, bit for bit
                assert x.tobytes() == ((parts[0] + parts[1]) + parts[2]).tobytes()
            else:  # the ring's
                assert np.allclose(x, parts[0] + parts[1] + parts[2], rtol=1e-12)
        assert counters == {"allreduce.host_sum.offloaded": 2, "allreduce.host_sum.fallback": 2,
                            "allreduce.host_sum.fallback.ring": 2, "host_sum.calls": 4, "host_sum.key_bytes": 32}
        assert len(log) == 1  # a warning the first time a reason comes up; the repeat is logged at INFO
        assert log[0] == f"rank {rank}: allreduce (group 0, seq 2) runs on the hosts with ring instead of host_sum: " \
                         "odd count 7"
    assert results[0][0][1].tobytes() == results[1][0][1].tobytes() == results[2][0][1].tobytes()


def test_offload_failure_reaches_every_rank(install_plugin: Any) -> None:
    install_plugin("testoffload", "testoffload")
    with World(3, {"algorithm.allreduce.host_sum.fail_rank": 1, "timeouts.collective": 30.0}) as w, \
            pytest.raises(RankFailure) as info:
        w.run(sums, "host_sum")
    errors = info.value.errors
    assert "host_sum refuses" in str(errors[1])
    for r in (0, 2):  # told by rank 1's abort, not by their timeout
        assert isinstance(errors[r], CollectiveError) and "rank 1" in str(errors[r]), errors[r]


def test_offload_answer_must_be_a_fallback(install_plugin: Any) -> None:
    install_plugin("testoffload", "testoffload")
    with World(2, {"timeouts.collective": 30.0}) as w, pytest.raises(RankFailure) as info:
        w.run(sums, "bad_answer")
    for r in (0, 1):
        assert isinstance(info.value.errors[r], PluginError)
        assert "algorithm 'bad_answer' of plugin 'testoffload' returned str; expected None or " \
               "erdma_core.sdk.Fallback" in str(info.value.errors[r])


def test_offload_only_for_offloadable_ops() -> None:
    from erdma_core import hookimpl

    class Plugin:
        @hookimpl
        def erdma_register_algorithms(self, register: Any) -> None:
            register("gather", "elsewhere", lambda ctx: None, offload=True)

    pm = pluggy.PluginManager("erdma")
    pm.add_hookspecs(hookspecs)
    pm.register(Plugin(), name="elsewhere")
    with pytest.raises(PluginError, match="plugin 'elsewhere' registered gather algorithm 'elsewhere' as an "
                                          "offload; offloads are run for allreduce, broadcast, reduce_scatter only"):
        _collect(pm, Components(pm, []))


def compressed(pg: Any) -> str:
    try:
        pg.allreduce(np.ones(4, np.float32), algorithm="host_sum")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def test_compression_an_offload_cannot_apply_is_refused(install_plugin: Any) -> None:
    install_plugin("testoffload", "testoffload")
    install_plugin("testcodecs", "testcodecs")
    with World(2, {"compression.name": "fp16", "timeouts.collective": 30.0}) as w:
        assert w.run(compressed) == ["ConfigError: allreduce algorithm 'host_sum' runs through an offload (plugin "
                                     "'testoffload'), which compression.name='fp16' cannot apply to; leave "
                                     "allreduce out of compression.ops or choose another algorithm"] * 2
    with World(2, {"compression.name": "fp16", "compression.ops": "broadcast"}) as w:
        assert w.run(compressed) == ["ok"] * 2
