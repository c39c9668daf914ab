"""The built-in TCP transport passes the conformance suite that transport plugins subclass."""

from typing import Any, ClassVar

from erdma_core.testing.conformance import TransportConformance


class TestTcpTransport(TransportConformance):
    transport = "tcp"


class TestTcpTransportSmallSocketBuffers(TransportConformance):
    transport = "tcp"
    config: ClassVar[dict[str, Any]] = {"transport.tcp.socket_buffer_bytes": 65536, "collectives.chunk_bytes": 65536}
