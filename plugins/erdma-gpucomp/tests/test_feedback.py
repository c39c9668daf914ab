"""Error feedback: the sum of what a site sends over many steps follows the sum of the true values (the loss
of each step is carried, not dropped), without it the error grows; residuals stay within their bound."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make
from erdma_gpucomp.feedback import ErrorFeedback

from erdma_core.sdk import Site

SITE = Site("grad", "allreduce", "ring", 0, 0, 1000)


def drift(name: str, feedback: bool, steps: int = 200, **settings) -> float:
    """max |sum of decoded - sum of true| over ``steps`` encodes of one site, relative to the true sum's scale."""
    codec = make(name, error_feedback=feedback, **settings)
    rng = np.random.default_rng(3)
    bias = rng.standard_normal(1000).astype(np.float32) * 0.01  # a consistent small signal under the noise
    sent = np.zeros(1000, np.float64)
    true = np.zeros(1000, np.float64)
    for _ in range(steps):
        g = (bias + rng.standard_normal(1000).astype(np.float32)).astype(np.float32)
        enc = codec.encode(g, "float32", SITE)
        out = np.empty_like(g)
        codec.decode(memoryview(np.frombuffer(enc.payload, np.uint8)), enc.meta, "float32", out)
        sent += out
        true += g
    return float(np.abs(sent - true).max() / np.abs(true).max())


@pytest.mark.parametrize("name, settings", [("int8", {}), ("int4", {}), ("topk", {"fraction": 0.05}),
                                            ("fp16", {}), ("bf16", {})])
def test_feedback_keeps_the_running_sum(name, settings):
    with_ef, without = drift(name, True, **settings), drift(name, False, **settings)
    # with feedback, the running sum is off by at most one step's error; without, errors pile up
    assert with_ef < without / 5, (with_ef, without)


def test_topk_without_feedback_loses_most_of_the_signal():
    """Top 1% alone sends almost none of a small steady signal under noise; with feedback it arrives late
    (what is still in the residual) but arrives (measured: 0.96 against 0.23)."""
    assert drift("topk", False, fraction=0.01) > 0.9
    assert drift("topk", True, fraction=0.01) < 0.3


def test_no_site_keeps_no_residual():
    codec = make("int8")
    codec.encode(np.ones(100, np.float32) / 3, "float32", None)
    assert len(codec.feedback) == 0


def test_residuals_are_bounded_oldest_first():
    fb = ErrorFeedback(max_bytes=3 * 400)
    for i in range(5):
        fb.keep(i, np.zeros(100, np.float32))
    assert len(fb) == 3 and fb.nbytes == 1200
    x = np.ones(100, np.float32)
    assert fb.take(0, x) is x  # dropped
    assert fb.take(4, x) is not x


def test_a_residual_of_another_shape_is_not_added():
    fb = ErrorFeedback(1 << 20)
    fb.keep("s", np.ones(10, np.float32))
    x = np.zeros(20, np.float32)
    assert fb.take("s", x) is x
