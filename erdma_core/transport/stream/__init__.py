"""Transports over stream sockets: ``SocketTransport`` (``socket_transport``, the base of the built-in TCP and
of any plugin's transport over TCP or Unix sockets), the progress driver that writes and reads the sockets
(``progress``), the authenticated accept during set-up (``accept``), TLS (``tls``) and single-copy reads
between ranks of one host (``single_copy``). A plugin reaches them through ``erdma_core.sdk``."""
