"""The built-in TCP transport passes the conformance suite that transport plugins subclass."""

from typing import Any, ClassVar

from erdma_core.testing.conformance import TransportConformance


class TestTcpTransport(TransportConformance):
    transport = "tcp"


class TestTcpTransportSmallSocketBuffers(TransportConformance):
    transport = "tcp"
    config: ClassVar[dict[str, Any]] = {"transport.tcp.socket_buffer_bytes": 65536, "collectives.chunk_bytes": 65536}


class TestTcpTransportOverTcp(TransportConformance):
    """Real TCP connections instead of the Unix sockets ranks of one host use: every frame sealed."""
    transport = "tcp"
    config: ClassVar[dict[str, Any]] = {"transport.tcp.local_sockets": False}
