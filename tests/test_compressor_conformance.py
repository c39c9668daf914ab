"""The compressor conformance kit (``erdma_core.testing.compressor_conformance``) on the core's ``none``, and
on made-up compressors that break the contract one way each: the kit must find each."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from erdma_core.compression import Encoded
from erdma_core.testing.compressor_conformance import CompressorConformance


class TestNone(CompressorConformance):
    compressor, encodes = "none", ()


class _Half:
    """float32 as float16, lossy; each flaw below breaks one rule."""

    name, lossy = "none", True

    def __init__(self, flaw: str = "") -> None:
        self.flaw, self.calls = flaw, 0

    def encode(self, data: np.ndarray, dtype: str, site: Any) -> Encoded | None:
        if dtype != "float32":
            return None
        self.calls += 1
        if self.flaw == "scribbles":
            data[:1] = 0
        if self.flaw == "stateful":
            return Encoded(data.astype(np.float16).tobytes(), bytes([self.calls % 2]))
        return Encoded(data.astype(np.float16).tobytes(), b"lossy" if self.flaw == "rough" else b"")

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None:
        values = np.frombuffer(payload, np.float16, min(len(payload) // 2, out.size)).astype(np.float32)
        if self.flaw != "lenient" and len(payload) != 2 * out.size:
            raise ValueError(f"{len(payload)} bytes for {out.size} elements")
        out[:values.size] = values * (1.5 if meta == b"lossy" else 1.0)


def _kit(flaw: str) -> CompressorConformance:
    class Kit(CompressorConformance):
        compressor, encodes, tolerance, feedback = "none", ("float32",), 1e-3, False

        def made(self, selected: bool = True) -> Any:
            return _Half(flaw)

    return Kit()


@pytest.mark.parametrize(("flaw", "test"), [
    ("scribbles", "test_every_dtype_and_size_round_trips_within_its_bound"),
    ("rough", "test_every_dtype_and_size_round_trips_within_its_bound"),
    ("lenient", "test_a_cut_or_grown_payload_is_refused_not_read_past"),
    ("stateful", "test_without_a_site_it_keeps_nothing_between_encodes"),
])
def test_the_kit_finds_a_compressor_that_breaks_a_rule(flaw: str, test: str) -> None:
    getattr(_kit(""), test)()  # the faultless one passes
    with pytest.raises(AssertionError):
        getattr(_kit(flaw), test)()


def test_the_kit_finds_a_lossy_compressor_whose_losses_never_arrive() -> None:
    kit = _kit("")
    type(kit).feedback = True  # the made-up codec keeps no residual: each step loses the same again
    with pytest.raises(AssertionError):
        kit.test_error_feedback_delivers_over_steps_what_one_encode_lost()
