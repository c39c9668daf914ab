"""Schedules are checked once, before they run: a schedule the executor could run wrongly is refused with
an error naming the algorithm and its plugin; the ``work`` buffer and algorithm options work as documented."""

from __future__ import annotations

import re

import numpy as np
import pytest
import testalgos

from erdma_core import ConfigError, PluginError, load_config
from erdma_core.algorithms.schedule import Copy, Spec, Step, Xfer
from erdma_core.engine.plans import check, plan
from erdma_core.plugins.manager import Component
from erdma_core.testing import World

SPEC = Spec("allreduce", 0, 2, 8)


@pytest.mark.parametrize("step,problem", [
    (Step(sends=(Xfer(1, "out", 0, 8),), recvs=(Xfer(1, "out", 0, 8, reduce=True),)),
     "step 0 sends out[0:8] to rank 1 and reduces a receive from rank 1 into out[0:8]: a step's receives may "
     "land while its sends still read"),
    (Step(sends=(Xfer(1, "out", 0, 4),), recvs=(Xfer(1, "out", 2, 4),)),
     "step 0 sends out[0:4] to rank 1 and receives from rank 1 into out[2:6]"),
    (Step(recvs=(Xfer(1, "out", 0, 4), Xfer(1, "out", 2, 4, reduce=True))),
     "step 0 receives out[0:4] from rank 1 and out[2:6] from rank 1: overlapping receives land in any order"),
    (Step(recvs=(Xfer(1, "out", 0, 9),)), "step 0 receives out[0:9], outside 'out' (8 elements)"),
    (Step(recvs=(Xfer(1, "in", 0, 0),)), "step 0 receives into in[0:0]: 'in' is the caller's input, read-only"),
    (Step(copies=(Copy("out", 0, "in", 0, 0),)), "step 0 copies into in[0:0]: 'in' is the caller's input"),
    (Step(sends=(Xfer(1, "scratch", 0, 1),)), "step 0 sends buffer 'scratch', which does not exist (buffers: in, "
                                               "out, work)"),
    (Step(sends=(Xfer(0, "out", 0, 1),)), "step 0 sends out[0:1] with rank 0, which is this rank"),
    (Step(sends=(Xfer(2, "out", 0, 1),)), "step 0 sends out[0:1] with rank 2, which is not a rank of the group"),
])
def test_check_names_what_is_wrong(step, problem):
    assert problem in (check([step], SPEC) or "")


def test_reduces_into_the_same_elements_in_order_are_fine():
    both = Step(recvs=(Xfer(1, "out", 0, 8, reduce=True), Xfer(1, "out", 0, 8, reduce=True)))
    work = Step(copies=(Copy("out", 0, "work", 0, 8),), sends=(Xfer(1, "work", 0, 8),),
                recvs=(Xfer(1, "out", 0, 8, reduce=True),))
    assert check([both, work], SPEC) is None


def test_plan_error_names_algorithm_and_plugin():
    comp = Component("algorithm", "naive_doubling", testalgos.naive_doubling, "testalgos", op="allreduce")
    with pytest.raises(PluginError) as info:
        plan(comp, Spec("allreduce", 1, 4, 100))
    assert str(info.value).startswith("algorithm 'naive_doubling' from plugin 'testalgos' gave an invalid schedule "
                                      "for allreduce on rank 1 of 4 (count 100): step 0 sends out[0:100] to rank 0")
    broken = Component("algorithm", "doubling", testalgos.doubling, "testalgos", op="allreduce")
    with pytest.raises(PluginError, match=r"algorithm 'doubling' from plugin 'testalgos' failed to build a "
                                          r"schedule for allreduce on rank 0 of 3 \(count 5\): ValueError: doubling "
                                          r"needs a power-of-two world, got 3"):
        plan(broken, Spec("allreduce", 0, 3, 5))


def run_algorithm(pg, name):
    a = np.arange(1000, dtype=np.float64) * (pg.rank() + 1)
    try:
        pg.allreduce(a, algorithm=name)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", bool((a == np.arange(1000) * (pg.size() * (pg.size() + 1) // 2)).all())


def test_unsafe_schedule_is_refused_on_every_rank(install_plugin):
    """Before: it ran, and ranks disagreed (2-15 wrong results of 15 at 3-4 ranks)."""
    install_plugin("testalgos", "testalgos")
    with World(4, {"timeouts.collective": 20.0}) as w:
        outcomes = w.run(run_algorithm, "naive_doubling")
    for rank, (kind, msg) in enumerate(outcomes):
        assert kind == "PluginError", (rank, kind, msg)
        assert f"algorithm 'naive_doubling' from plugin 'testalgos' gave an invalid schedule for allreduce on rank " \
               f"{rank} of 4" in msg


@pytest.mark.parametrize("size", [2, 4])
def test_work_buffer_is_there_for_allreduce(install_plugin, size):
    """Before: a bare KeyError: 'work' at executor.py on every rank."""
    install_plugin("testalgos", "testalgos")
    with World(size) as w:
        assert w.run(run_algorithm, "doubling") == [("ok", True)] * size


def test_algorithm_options_come_from_their_section(install_plugin, tmp_path):
    install_plugin("testalgos", "testalgos")
    conf = load_config({"algorithm.allreduce.shards.k": 3, "algorithm.allreduce.parameter_server.servers": 2})
    assert conf["algorithm.allreduce.shards.k"] == 3 and conf["algorithm.allreduce.parameter_server.servers"] == 2
    bad = "config key 'algorithm.allreduce.shards.k': value 0 is below the minimum 1"
    with pytest.raises(ConfigError, match=re.escape(bad)):
        load_config({"algorithm.allreduce.shards.k": 0})
    with World(3, {"algorithm.allreduce.shards.k": 3, "algorithm.allreduce.parameter_server.servers": 3}) as w:
        assert w.run(run_algorithm, "shards") == [("ok", True)] * 3
        assert w.run(run_algorithm, "parameter_server") == [("ok", True)] * 3
