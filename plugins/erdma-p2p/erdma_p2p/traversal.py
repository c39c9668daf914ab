"""``traversal = "stun"``: a UDP socket bound once, its public mapping learned from a STUN server through that
very socket, handed to the datagram transport (erdma-quic) so the mapping stays in use; and before a peer
dials, a datagram from this socket to each of the peer's addresses opens this rank's NAT to it (hole
punching, for NATs that map endpoint-independently). For the built-in TCP, a TCP port instead, its mapping
learned over TCP from the same server (``tcp_socket``): the transport meets each peer from it, both
connecting at once (``erdma_core.net.meet``).

With ``relay`` set, every rank also takes an allocation on that TURN server through the same socket
(``relayed.py``), and offers three kinds of candidates (ICE's): its own address (``host``; dialled only by a
peer behind the same public address), its NAT's mapping (``srflx``), and the relayed address (``relay``).
A dialling peer checks them at once, in that order of preference, and keeps the first that answers within
``check_timeout``, else the best other one that answered (erdma-quic; the built-in TCP tries them in turn):
what is used is decided by connecting, not by what the NAT looks like. A peer's packets that arrive through the relay
are answered through it; the rest go straight. After an outage the transport goes through the candidates
again, so a direct path that stops working falls back to the relay.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from erdma_core.sdk import Candidate, ConfigError
from erdma_core.toolkit import meet, route_source

from . import kept, stun
from .checks import check_stun, stun_server
from .relayed import PUNCH, RelayedSocket, allocate
from .turn import TurnError
from .turn_tcp import TcpDatagrams

log = logging.getLogger("erdma.p2p")


def server_address(value: str, key: str = "traversal.stun.server") -> tuple[str, int]:
    """``HOST:PORT`` of a STUN server, resolved; a ConfigError naming the key otherwise."""
    host, port = stun_server(value, key)
    try:
        return socket.gethostbyname(host), port
    except OSError as exc:
        raise ConfigError(f"config key {key!r}: host {host!r} does not resolve: {exc}") from None


def _udp(address: tuple[str, int]) -> socket.socket:
    """A UDP socket bound to ``address``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


class StunTraversal:
    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        check_stun(config, section)  # (as load_config did: a traversal made from a config built otherwise)
        self.server = server_address(section["server"])
        self.timeout = section["timeout"]
        self.check_timeout = section["check_timeout"]
        self.bind = (section["bind_address"] or "0.0.0.0", section["port"])
        self.punches = section["punch"]
        self.relay = server_address(section["relay"], "traversal.stun.relay") if section["relay"] else None
        self.always = section["relay_when"] == "always"
        self.relay_over = section.get("relay_over", "auto")
        self.over_tcp = False  # every peer through the relay, over TCP or TLS to it (``_relay_over_tcp``)
        self.tls_port, self.ca = section.get("relay_tls_port", 5349), section.get("relay_ca", "")
        self.credentials = (section["relay_user"], section["relay_password"])
        self.mapped: stun.Mapped | None = None
        self.relayed: stun.Mapped | None = None  # the relay allocation's address
        self.sock: RelayedSocket | None = None  # the data socket, when it has a relay allocation
        self.local_port: int | None = None  # the prepared socket's
        self.lanes: dict[int, stun.Mapped] = {}  # local port -> mapping, of the sockets udp_sockets prepared
        self.tcp_mapped: stun.Mapped | None = None  # the TCP socket's mapping (``tcp_socket``)
        self.tcp_port: int | None = None
        self._binding = threading.Lock()  # a paired job prepares its UDP and TCP sockets at once, on two threads

    def udp_socket(self) -> socket.socket:
        """The data socket, bound, with its mapping learned (raises StunError naming the server within the
        timeout when no answer comes) and, with ``relay`` set, its relay allocation taken (TurnError)."""
        if self.relay is not None and self.relay_over in ("tcp", "tls"):
            return self._relay_over_tcp(tls=self.relay_over == "tls")
        lent = self._kept()
        if lent is not None:
            return lent
        sock = self._bound(_udp, tcp=False)
        try:
            try:
                self.mapped = stun.query(sock, self.server, self.timeout)
            except stun.StunError as exc:
                if self.relay is None or self.relay_over != "auto":
                    raise
                log.warning("%s; taking every path through the TURN server %s:%d over TCP (relay_over = 'auto')",
                            exc, *self.relay)
                sock.close()
                return self._relay_over_tcp()
            if self.relay is None:
                return kept.keep(self._key(), kept.Prepared(sock, self.mapped))
            relayed = allocate(sock, self.relay, *self.credentials, self.timeout)
            self.relayed = relayed.client.relayed
            assert self.relayed is not None
            self.sock = kept.keep(self._key(), kept.Prepared(relayed, self.mapped))
            if self.always:
                log.warning("relayed: all traffic goes through the TURN server %s:%d (relayed address %s:%d) "
                            "because relay_when = 'always'", *self.relay, *self.relayed)
            else:
                log.info("relay allocation %s:%d on the TURN server %s:%d: the last candidate, for peers no direct "
                         "path reaches", *self.relayed, *self.relay)
            return self.sock  # type: ignore[return-value]
        except BaseException:
            sock.close()
            raise

    def _key(self) -> tuple[Any, ...]:
        """What a kept data socket must have been prepared with to serve this traversal (``kept``)."""
        return self.bind, self.server, self.relay, self.credentials

    def _kept(self) -> Any:
        """A data socket an earlier set-up of this process prepared with the same settings, with its mapping and
        relay allocation (``kept``); None when there is none to lend."""
        got = kept.take(self._key(), time.monotonic())
        if got is None:
            return None
        prepared, lease = got
        with self._binding:
            if lease.getsockname()[1] == self.tcp_port:  # ``candidates`` tells the two apart by port: a new one
                lease.close()
                return None
            self.local_port = lease.getsockname()[1]
        self.mapped, self.relayed = prepared.mapped, prepared.relayed
        if prepared.relayed is not None:
            self.sock = lease
        log.info("data socket (port %d, mapped to %s:%d%s) kept from an earlier set-up of this process: no STUN "
                 "query, no new allocation", self.local_port, *self.mapped,
                 f", relay allocation {self.relayed.host}:{self.relayed.port}" if self.relayed else "")
        return lease

    def _relay_over_tcp(self, tls: bool = False) -> Any:
        """The data socket as TURN over TCP, or TLS (``turn_tcp``): one connection to the relay server (its TLS
        port for TLS; with relay_over = 'auto', TLS when TCP cannot connect), an allocation taken over it, and
        every peer reached through the relayed address (TurnError, StunError or OSError naming the server within
        the timeout when it cannot be had)."""
        assert self.relay is not None
        server = (self.relay[0], self.tls_port) if tls else self.relay
        where = f"{server[0]}:{server[1]}"
        try:
            stream = TcpDatagrams.connect(server, self.timeout, self._tls() if tls else None)
        except ssl.SSLError as exc:
            raise TurnError(f"TURN server {where}: its TLS certificate was not accepted (traversal.stun.relay_ca = "
                            f"{self.ca or 'the system CAs'!r}): {exc}") from None
        except OSError as exc:
            if not tls and self.relay_over == "auto":
                log.warning("TURN server %s: no TCP connection within %.1fs (%s); trying TLS on port %d", where,
                            self.timeout, exc, self.tls_port)
                return self._relay_over_tcp(tls=True)
            raise TurnError(f"TURN server {where}: no {'TLS' if tls else 'TCP'} connection within "
                            f"{self.timeout:.1f}s: {exc}") from None
        try:
            self.sock = allocate(stream, server, *self.credentials, self.timeout, direct=False)
        except BaseException:
            stream.close()
            raise
        self.relayed, self.over_tcp = self.sock.client.relayed, True
        self.local_port = stream.getsockname()[1]
        assert self.relayed is not None
        log.warning("relayed over %s: every peer goes through the TURN server %s (relayed address %s:%d)",
                    "TLS" if tls else "TCP", where, *self.relayed)
        return self.sock

    def _tls(self) -> ssl.SSLContext:
        """What checks the TURN server's certificate: relay_ca's CAs (the system's when empty), the name of the
        relay's host, TLS 1.2 at least."""
        context = ssl.create_default_context(cafile=self.ca or None)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

    def udp_sockets(self, count: int) -> list[socket.socket]:
        """``count`` more data sockets for a transport that stripes (one per lane), each bound to a free port
        with its own mapping learned; refused with a relay (the relay client cannot follow a socket into
        another process, and a lane has no path when the direct one fails)."""
        if self.relay is not None:
            raise ConfigError("transport.quic.workers needs a socket per lane, each in its worker process, and "
                              "traversal.stun.relay gives every rank a relay allocation on its data socket, whose "
                              "client stays in this process; valid here: 0 (or no relay)")
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

    def _bound(self, bind: Callable[[tuple[str, int]], socket.socket], tcp: bool) -> socket.socket:
        """A socket ``bind(address)`` makes at ``bind_address``/``port``, on another port number than the other
        kind's (the TCP socket's for the UDP one, and the other way round: ``candidates`` tells them apart by
        port); its port is noted as ``tcp_port`` or ``local_port``."""
        with self._binding:
            other = self.local_port if tcp else self.tcp_port
            for _ in range(8):
                sock = bind(self.bind)
                port = sock.getsockname()[1]
                if other is None or port != other:
                    if tcp:
                        self.tcp_port = port
                    else:
                        self.local_port = port
                    return sock
                sock.close()
        raise ConfigError(f"traversal.stun: no free port other than {other} for the {'TCP' if tcp else 'data'} socket")

    def tcp_socket(self) -> socket.socket:
        """A TCP socket bound to ``bind_address``/``port`` (SO_REUSEADDR, SO_REUSEPORT: the transport's
        meetings bind beside it), with the NAT's TCP mapping of that port learned from the STUN server over
        TCP (StunError naming the server within the timeout when no answer comes). A stream transport meets
        its peers from it: both ends connect at once (``erdma_core.net.meet``), so each opens its own
        NAT; refused with punch off (meeting is the punch). With a relay, the pairs that do not meet over TCP
        are a datagram transport's (``transport.fallback``), which then asks for ``udp_socket``."""
        if not self.punches:
            raise ConfigError("config key 'traversal.stun.punch': value False cannot be kept by transport.name = "
                              "\"tcp\": a rank behind a NAT opens it by connecting to its peer as the peer connects "
                              "to it; valid here: true")
        sock = self._bound(meet.bound_to, tcp=True)
        try:
            self.tcp_mapped = stun.query_tcp(sock.getsockname()[:2], self.server, self.timeout)
        except BaseException:
            sock.close()
            raise
        log.info("TCP port %d is mapped to %s:%d", self.tcp_port, *self.tcp_mapped)
        return sock

    def candidates(self, host: str, port: int) -> list[Candidate]:
        """This rank's addresses, in the order peers try them: its own (behind a NAT: for a peer at the same
        site), its NAT's mapping, its relay allocation (none for the TCP socket)."""
        if port in self.lanes:
            return [Candidate(self.lanes[port].host, self.lanes[port].port, "srflx")]
        if self.tcp_mapped is not None and port == self.tcp_port:
            return self._own(port, self.tcp_mapped)
        if self.over_tcp and port == self.local_port and self.relayed is not None:
            return [Candidate(self.relayed.host, self.relayed.port, "relay")]  # no other way in
        if self.mapped is None or port != self.local_port:
            raise ConfigError(f"config key 'traversal.name': value 'stun' needs a transport that runs on the "
                              f"socket it prepared (UDP port {self.local_port}, TCP port {self.tcp_port}), such as "
                              f"erdma-quic (transport.name = \"quic\") or the built-in TCP; this transport listens "
                              f"on {host}:{port}")
        out = self._own(port, self.mapped)
        if self.relayed is not None:
            out.append(Candidate(self.relayed.host, self.relayed.port, "relay"))
        return out

    def _own(self, port: int, mapped: stun.Mapped) -> list[Candidate]:
        """This rank's own address of ``port`` (unless it is the mapping: no NAT) and its mapping."""
        srflx = Candidate(mapped.host, mapped.port, "srflx")
        local = self.bind[0] if self.bind[0] != "0.0.0.0" else route_source(self.server[0])  # towards the server
        return [srflx] if (local, port) == srflx[:2] else [Candidate(local, port, "host"), srflx]

    def advertise(self, host: str, port: int) -> tuple[str, int]:
        """The address a peer tries first among ``candidates`` (a striping lane: its mapping)."""
        first = self.candidates(host, port)[-1 if self.always else 0]
        return first.host, first.port

    def dial_plan(self, cands: list[Candidate]) -> tuple[list[Candidate], float]:
        """Of a peer's candidates, those to try, in order of preference: its own address only when it is behind
        the same public address as this rank (the same site), then its mapping, then its relay; only the relay
        with ``relay_when = "always"``. The first has ``check_timeout`` to answer before the best other that
        answered is taken (checked at once over QUIC; over TCP each in turn)."""
        if self.always:
            return [c for c in cands if c.kind == "relay"], self.check_timeout
        mine = next((m.host for m in (self.mapped, self.tcp_mapped) if m is not None), None)
        same_site = any(c.kind == "srflx" and c.host == mine for c in cands)
        plan = [c for c in cands if c.kind == "host" and same_site]
        plan += [c for c in cands if c.kind == "srflx"] + [c for c in cands if c.kind == "relay"]
        return plan, self.check_timeout

    def punch(self, host: str, port: int) -> bytes | None:
        """For each of a peer's candidates, before it dials: a permission on this rank's relay for its host
        (so its packets reach the relayed address), and the datagram that opens this rank's NAT to it."""
        if self.sock is not None:
            self.sock.permit(host)
        return PUNCH if self.punches else None
