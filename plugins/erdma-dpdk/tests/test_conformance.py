"""The core's transport conformance suite over memif (separate processes, as every test world is): with the
defaults, and with small frames, a small window and 1% of data packets dropped on arrival (recovered by
selective retransmission, byte for byte)."""

from __future__ import annotations

from typing import Any, ClassVar

from erdma_core.testing.conformance import TransportConformance

from .conftest import needs_dpdk


@needs_dpdk
class TestMemif(TransportConformance):
    transport = "dpdk"


@needs_dpdk
class TestMemifLossy(TransportConformance):
    transport = "dpdk"
    config: ClassVar[dict[str, Any]] = {"transport.dpdk.inject_loss": 0.01, "transport.dpdk.window": 32,
                                        "transport.dpdk.frame_bytes": 1500, "transport.dpdk.rto_min_us": 1000}
