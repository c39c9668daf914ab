"""``traversal = "stun"``: a UDP socket bound once, its public mapping learned from a STUN server through that
very socket, handed to the datagram transport (erdma-quic) so the mapping stays in use; peers dial the mapped
address; and before a peer dials, a datagram from this socket to the peer's mapped address opens this rank's
NAT to it (hole punching, for NATs that map endpoint-independently; a NAT that maps per destination needs a
relay, which this strategy does not have yet).
"""

from __future__ import annotations

import socket
from typing import Any

from erdma_core.errors import ConfigError

from . import stun

PUNCH = b"\x00erdma-punch"  # not a QUIC packet (the fixed bit is 0): a QUIC endpoint drops it


def server_address(value: str, what: str = "config key 'traversal.stun.server'") -> tuple[str, int]:
    """``HOST:PORT`` of a STUN server, resolved; a ConfigError naming ``what`` otherwise."""
    host, sep, port = value.rpartition(":")
    if not value or not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: value {value!r} is not HOST:PORT of a STUN server "
                          "(e.g. stun.example.org:3478; coturn serves STUN on 3478)")
    try:
        return socket.gethostbyname(host), int(port)
    except OSError as exc:
        raise ConfigError(f"{what}: host {host!r} does not resolve: {exc}") from None


class StunTraversal:
    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        self.server = server_address(section["server"])
        self.timeout = section["timeout"]
        self.bind = (section["bind_address"] or "0.0.0.0", section["port"])
        self.punches = section["punch"]
        self.mapped: stun.Mapped | None = None
        self.local_port: int | None = None  # the prepared socket's

    def udp_socket(self) -> socket.socket:
        """The data socket, bound, with its mapping learned (raises StunError naming the server within the
        timeout when no answer comes)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.bind(self.bind)
            self.mapped = stun.query(sock, self.server, self.timeout)
            self.local_port = sock.getsockname()[1]
        except BaseException:
            sock.close()
            raise
        return sock

    def advertise(self, host: str, port: int) -> tuple[str, int]:
        """The STUN mapping of the prepared socket; a transport that listens elsewhere cannot use it."""
        if self.mapped is None or port != self.local_port:
            raise ConfigError(f"config key 'traversal.name': value 'stun' needs a datagram transport that runs on "
                              f"the UDP socket it prepared (port {self.local_port}), such as erdma-quic "
                              f"(transport.name = \"quic\"); this transport listens on {host}:{port}")
        return self.mapped.host, self.mapped.port

    def punch(self, host: str, port: int) -> bytes | None:
        return PUNCH if self.punches else None
