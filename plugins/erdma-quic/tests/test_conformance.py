"""The core's transport conformance tests, over QUIC with mutual TLS."""

from __future__ import annotations

from typing import Any

import pytest

from erdma_core.testing.conformance import TransportConformance


class TestQuicConformance(TransportConformance):
    transport = "quic"

    @pytest.fixture(autouse=True)
    def _credentials(self, quic_config: dict[str, Any]) -> None:
        self.config = quic_config


class TestQuicStripedConformance(TransportConformance):
    """The same, with every message above 64 KiB striped over the rank's own connection and a worker's."""

    transport = "quic"

    @pytest.fixture(autouse=True)
    def _credentials(self, quic_config: dict[str, Any]) -> None:
        self.config = {**quic_config, "transport.quic.workers": 1, "transport.quic.part_bytes": 65536}
