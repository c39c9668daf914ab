"""The built-in TCP transport: ``TcpTransport`` (``transport``), a ``SocketTransport`` (``..stream``) that
listens and dials over TCP, and over Unix sockets between ranks of one host. The congestion controller it
sets on each connection is chosen in ``erdma_core.net.congestion``."""

from .transport import TcpTransport

__all__ = ["TcpTransport"]
