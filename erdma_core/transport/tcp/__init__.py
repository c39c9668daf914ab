"""The built-in TCP transport: ``TcpTransport`` (``transport``) on ``SocketTransport`` (``stream``, the base of
every transport over stream sockets), the progress driver that writes and reads the sockets (``progress``),
the authenticated accept (``accept``), TLS (``tls``) and single-copy reads between ranks of one host
(``single_copy``). What every transport shares is one floor up, in ``erdma_core.transport``; a plugin uses it
through ``erdma_core.sdk``."""

from .transport import TcpTransport

__all__ = ["TcpTransport"]
