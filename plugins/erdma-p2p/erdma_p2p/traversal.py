"""``traversal = "stun"``: a UDP socket bound once, its public mapping learned from a STUN server through that
very socket, handed to the datagram transport (erdma-quic) so the mapping stays in use; peers dial the mapped
address; and before a peer dials, a datagram from this socket to the peer's mapped address opens this rank's
NAT to it (hole punching, for NATs that map endpoint-independently).

A rank behind a NAT that maps each destination to a new port (symmetric) cannot be reached that way. With
``relay`` set, such a rank (or every rank: ``relay_when = "always"``) takes an allocation on that TURN server
through the same socket, advertises the relayed address, and sends all its traffic through the relay
(``relayed.py``); its peers need nothing special. Whether the NAT maps per destination is seen, not guessed:
the socket asks ``server`` and ``check_server`` and compares the two mappings.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from erdma_core.errors import ConfigError

from . import stun
from .relayed import allocate

log = logging.getLogger("erdma.p2p")
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
        self.relay = server_address(section["relay"], "config key 'traversal.stun.relay'") if section["relay"] else None
        self.relay_when = section["relay_when"]
        self.credentials = (section["relay_user"], section["relay_password"])
        self.check = None
        if section["check_server"]:
            self.check = server_address(section["check_server"], "config key 'traversal.stun.check_server'")
        if self.relay is not None and self.relay_when == "dependent-mapping" and self.check is None:
            raise ConfigError("config key 'traversal.stun.relay_when': value 'dependent-mapping' needs "
                              "traversal.stun.check_server (a second STUN server, at another address) to see whether "
                              "the NAT maps per destination; set it, or relay_when = 'always'")
        if self.relay is not None and not all(self.credentials):
            raise ConfigError("config key 'traversal.stun.relay': a TURN server needs traversal.stun.relay_user and "
                              "traversal.stun.relay_password (its long-term credentials)")
        self.mapped: stun.Mapped | None = None
        self.relayed: stun.Mapped | None = None  # the relay allocation's address, when this rank relays
        self.local_port: int | None = None  # the prepared socket's
        self.lanes: dict[int, stun.Mapped] = {}  # local port -> mapping, of the sockets udp_sockets prepared

    def udp_socket(self) -> socket.socket:
        """The data socket, bound, with its mapping learned (raises StunError naming the server within the
        timeout when no answer comes)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.bind(self.bind)
            self.mapped = stun.query(sock, self.server, self.timeout)
            self.local_port = sock.getsockname()[1]
            if self.relay is None:
                return sock
            why = "relay_when = 'always'"
            if self.relay_when == "dependent-mapping":
                assert self.check is not None
                other = stun.query(sock, self.check, self.timeout)
                if other == self.mapped:
                    log.info("direct: this socket's NAT mapping %s:%d is the same towards %s:%d and %s:%d (hole "
                             "punching works; no relay)", *self.mapped, *self.server, *self.check)
                    return sock
                why = (f"its NAT maps per destination ({self.mapped.host}:{self.mapped.port} towards "
                       f"{self.server[0]}:{self.server[1]}, {other.host}:{other.port} towards "
                       f"{self.check[0]}:{self.check[1]})")
            relayed = allocate(sock, self.relay, *self.credentials, self.timeout)
            self.relayed = relayed.client.relayed
            assert self.relayed is not None
            log.warning("relayed: all traffic goes through the TURN server %s:%d (relayed address %s:%d) because %s",
                        *self.relay, *self.relayed, why)
            return relayed  # type: ignore[return-value]
        except BaseException:
            sock.close()
            raise

    def udp_sockets(self, count: int) -> list[socket.socket]:
        """``count`` more data sockets for a transport that stripes (one per lane), each bound to a free port
        with its own mapping learned; refused when this rank relays (the relay client cannot follow a socket
        into another process)."""
        if self.relayed is not None:
            raise ConfigError("transport.quic.workers needs a socket per lane, each in its worker process, and this "
                              "rank relays through a TURN server (traversal.stun.relay), whose client stays in this "
                              "process; valid here: 0 (or a rank whose NAT lets it punch)")
        socks: list[socket.socket] = []
        try:
            for _ in range(count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(sock)
                sock.bind((self.bind[0], 0))
                self.lanes[sock.getsockname()[1]] = stun.query(sock, self.server, self.timeout)
        except BaseException:
            for sock in socks:
                sock.close()
            raise
        return socks

    def advertise(self, host: str, port: int) -> tuple[str, int]:
        """The STUN mapping of the prepared socket; a transport that listens elsewhere cannot use it."""
        if port in self.lanes:
            return self.lanes[port].host, self.lanes[port].port
        if self.mapped is None or port != self.local_port:
            raise ConfigError(f"config key 'traversal.name': value 'stun' needs a datagram transport that runs on "
                              f"the UDP socket it prepared (port {self.local_port}), such as erdma-quic "
                              f"(transport.name = \"quic\"); this transport listens on {host}:{port}")
        if self.relayed is not None:
            return self.relayed.host, self.relayed.port
        return self.mapped.host, self.mapped.port

    def punch(self, host: str, port: int) -> bytes | None:
        # a relaying rank always sends it: through the relay, it is what gives the peer its permission there
        return PUNCH if self.punches or self.relayed is not None else None
