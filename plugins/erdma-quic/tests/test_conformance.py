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
