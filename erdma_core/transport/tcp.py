"""The built-in TCP transport: one connection per pair of ranks (``SocketTransport``), payloads received
in place. This module only chooses addresses and socket options."""

from __future__ import annotations

import socket
from typing import Any

from . import addresses
from .base import TransportContext
from .sockets import dial
from .stream import SocketTransport


class TcpTransport(SocketTransport):
    """Factory signature for the registry: ``TcpTransport(config, section)``."""

    name = "TCP"
    key = "tcp"
    devices = frozenset({"cpu"})  # host memory only: CUDA tensors are staged by the front end

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        super().__init__()
        self.opts = section

    def listen(self, ctx: TransportContext) -> tuple[socket.socket, str]:
        bind_host, advertised = addresses.choose(self.opts["bind_address"], self.opts["interface"],
                                                 getattr(ctx.store, "host", None))
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind_host, self.opts["port"]))
        listener.listen(max(8, ctx.world_size))
        host, port = advertised, listener.getsockname()[1]
        if ctx.advertise is not None:
            host, port = ctx.advertise(host, port)
        return listener, f"{host}:{port}"

    def dial(self, address: str, deadline: float) -> socket.socket:
        host, port = address.rsplit(":", 1)
        return dial(host, int(port), deadline)

    def tune(self, sock: socket.socket) -> None:
        if self.opts["nodelay"]:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.opts["keepalive"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        if self.opts["socket_buffer_bytes"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.opts["socket_buffer_bytes"])
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.opts["socket_buffer_bytes"])
