"""A transport over Unix-domain stream sockets. ``SocketTransport`` (the core's base for stream sockets)
does the rest: connecting every pair, the handshake that proves a peer belongs to the job, framing, matching,
ABORT, BYE and lost peers. This class says where to listen and how to dial."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from typing import Any

from erdma_core.sdk import TransportContext
from erdma_core.toolkit import SocketTransport, retrying


class UnixTransport(SocketTransport):
    name = "Unix"  # errors say "lost rank 1 over Unix: ..."
    key = "unix"  # addresses are published in the job's store under unix/addr/<rank>

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        super().__init__()
        self.folder = section["folder"] or tempfile.gettempdir()
        self.path = ""

    def listen(self, ctx: TransportContext) -> list[tuple[socket.socket, str]]:
        self.path = os.path.join(self.folder, f"erdma-{ctx.job:016x}-{ctx.rank}.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(ctx.world_size)
        return [(listener, self.path)]  # one listening socket, and the address peers dial

    def dial(self, address: str, deadline: float) -> socket.socket:
        def connect(timeout: float) -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(address)
            except OSError:
                sock.close()
                raise
            return sock

        return retrying(connect, deadline)

    def shutdown(self) -> None:
        super().shutdown()
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
