"""The built-in TCP transport: one connection per pair of ranks, or a pool of ``connections`` of them
(``SocketTransport``), payloads received in place. This module only chooses addresses and socket options.
Ranks on the same host (and in the same network namespace) connect over a Unix-domain socket instead,
unless ``local_sockets`` is off: the same bytes without the TCP stack, several times faster for small
messages; and large messages between them are copied once, by the receiver, from the sender's memory
(``single_copy_bytes``, ``single_copy``)."""

from __future__ import annotations

import functools
import os
import socket
from typing import Any

from ...errors import ConfigError
from ...net import addresses, congestion
from ...net.sockets import dial, retrying
from ..base import TransportContext
from ..stream.socket_transport import BACKLOG, SocketTransport


@functools.cache
def host_identity() -> str:
    """What ranks that can reach each other's abstract Unix sockets share: the boot and the network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""  # not Linux: no local sockets
    return f"{boot}.{netns}"


class TcpTransport(SocketTransport):
    """Factory signature for the registry: ``TcpTransport(config, section)``."""

    name = "TCP"
    key = "tcp"
    devices = frozenset({"cpu"})  # host memory only: CUDA tensors are staged by the front end

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        super().__init__()
        self.opts = section
        self.give_up = config["timeouts.collective"] if config is not None else 300.0  # TCP_USER_TIMEOUT
        self.spin = section["spin_us"] / 1e6
        self.tls = section["tls"]
        self.lend_bytes = section["single_copy_bytes"] if section["local_sockets"] else 0
        self.connections = section["connections"]
        self.congestion = congestion.choose(section["congestion"])  # None: the host's default

    def meeting_point(self, ctx: TransportContext) -> tuple[socket.socket, list[addresses.Candidate]] | None:
        """The traversal's TCP socket (``ctx.tcp_socket``: bound, its NAT mapping learned), where this rank
        meets the peers of other hosts instead of listening; its candidates as the traversal gives them."""
        if ctx.tcp_socket is None:
            return None
        if self.connections > 1:
            raise ConfigError(f"config key 'transport.tcp.connections': value {self.connections} cannot take effect "
                              "when the traversal prepares this rank's TCP socket: a pair meets through its NATs "
                              "from one mapped port each, so it has one connection; set 1")
        for key in ("port", "bind_address", "interface"):
            if self.opts[key]:
                raise ConfigError(f"config key 'transport.tcp.{key}': value {self.opts[key]!r} is not used when the "
                                  "traversal prepares this rank's TCP socket (its own port and bind_address decide "
                                  "where this rank meets its peers); leave it unset")
        sock = ctx.tcp_socket()
        bound, port = sock.getsockname()[:2]
        host = bound if bound not in ("0.0.0.0", "") else addresses.choose("", "", getattr(ctx.store, "host", None))[1]
        if ctx.candidates is not None:
            return sock, list(ctx.candidates(host, port))
        return sock, [addresses.Candidate(*(ctx.advertise(host, port) if ctx.advertise else (host, port)))]

    def nearby(self, address: str) -> bool:
        """A Unix socket of a rank on this host (and in this network namespace)."""
        if not address.startswith("local:"):
            return False
        return bool(self.opts["local_sockets"]) and address.split(":", 2)[1] == host_identity()

    def listen(self, ctx: TransportContext) -> list[tuple[socket.socket, str]]:
        listening = []
        if self.meeting is None:
            bind_host, advertised = addresses.choose(self.opts["bind_address"], self.opts["interface"],
                                                     getattr(ctx.store, "host", None))
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((bind_host, self.opts["port"]))
            listener.listen(BACKLOG)
            host, port = advertised, listener.getsockname()[1]
            if ctx.advertise is not None:
                host, port = ctx.advertise(host, port)
            listening.append((listener, f"{host}:{port}"))
        ident = host_identity()
        if self.opts["local_sockets"] and ident:
            name = f"erdma-{ctx.job & 0xFFFFFFFFFFFFFFFF:016x}-{ctx.rank}-{os.getpid()}"
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            local.bind("\0" + name)  # abstract: no file to clean up, visible only in this network namespace
            local.listen(BACKLOG)
            listening.insert(0, (local, f"local:{ident}:{name}"))
        return listening

    def dial(self, address: str, deadline: float) -> socket.socket | None:
        if address.startswith("local:"):
            if not self.nearby(address):
                return None
            name = address.split(":", 2)[2]

            def connect(timeout: float) -> socket.socket:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect("\0" + name)
                except OSError:
                    sock.close()
                    raise
                return sock

            return retrying(connect, deadline)
        host, port = address.rsplit(":", 1)
        return dial(host, int(port), deadline)

    def tune(self, sock: socket.socket) -> None:
        if self.opts["socket_buffer_bytes"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.opts["socket_buffer_bytes"])
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.opts["socket_buffer_bytes"])
        if sock.family != socket.AF_INET:
            return
        if self.opts["nodelay"]:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.congestion is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, self.congestion.encode())
        # a connection is given up when what it sent (or a keepalive probe) has gone unacknowledged for the
        # collective timeout, not earlier: a lossy link that still delivers is not cut
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.give_up * 1000))
        if self.opts["keepalive"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 127)
