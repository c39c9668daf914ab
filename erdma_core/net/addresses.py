"""Choosing the address a rank listens on and advertises (never just whatever the hostname resolves to)."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Any, NamedTuple

from ..errors import ConfigError

_SIOCGIFADDR = 0x8915


def interface_ipv4(name: str) -> str:
    """IPv4 address of the network interface ``name`` (e.g. ``eth0``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            names = ", ".join(n for _, n in socket.if_nameindex())
            raise ConfigError(f"config key 'transport.tcp.interface': value {name!r} has no IPv4 address "
                              f"({exc.strerror}); interfaces here: {names}") from None
    return socket.inet_ntoa(packed[20:24])


def route_source(towards: str) -> str:
    """The local address the kernel would use to reach ``towards``."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(towards)).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((towards, 9))  # UDP connect sends nothing; it only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def local_address(host: str) -> str:
    """``host`` (the value of ``transport.tcp.bind_address``), checked: it resolves to an IPv4 address of this
    host. Returns it unchanged."""
    key = f"config key 'transport.tcp.bind_address': value {host!r}"
    try:
        addr = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"{key} does not resolve to an IPv4 address ({exc})") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((addr, 0))
        except OSError as exc:
            raise ConfigError(f"{key} ({addr}) is not an address of this host ({exc.strerror}); leave it empty "
                              "for the address that routes to the discovery host") from None
    return host


def choose(bind_address: str, interface: str, towards: str | None) -> tuple[str, str]:
    """Return ``(bind host, advertised host)`` from the config and the discovery host."""
    if interface:
        host = interface_ipv4(interface)
        return host, host
    if bind_address and bind_address not in ("0.0.0.0", "::"):
        return local_address(bind_address), bind_address
    advertised = route_source(towards) if towards else "127.0.0.1"
    return (bind_address or advertised), advertised


class Candidate(NamedTuple):
    """One address a rank can be reached at, as a traversal offers it: ``kind`` is ``host`` (its own
    interface), ``srflx`` (its NAT's mapping, server-reflexive) or ``relay`` (an allocation on a TURN server);
    ``prflx`` (peer-reflexive) names an address a peer's connection came from that no candidate published."""

    host: str
    port: int
    kind: str = "host"

    def text(self) -> str:
        """``HOST:PORT`` for a host candidate (what a transport with no traversal publishes), else with the kind."""
        return f"{self.host}:{self.port}" + (f" {self.kind}" if self.kind != "host" else "")


def published(store: Any, key: str, timeout: float) -> tuple[str, int]:
    """The ``host:port`` a rank published under ``key`` in the discovery store (the first of its candidates,
    when it published several), host resolved to an IPv4 address (waits up to ``timeout`` seconds for it, as
    ``store.get`` does)."""
    first = published_candidates(store, key, timeout)[0]
    return first.host, first.port


def published_candidates(store: Any, key: str, timeout: float) -> list[Candidate]:
    """Every candidate a rank published under ``key`` (waits up to ``timeout`` seconds, as ``store.get``)."""
    return candidates(store.get(key, timeout).decode())


def candidates(value: str) -> list[Candidate]:
    """A published value, ``HOST:PORT[ KIND][,HOST:PORT[ KIND]...]``, as candidates (hosts resolved)."""
    out = []
    for item in value.split(","):
        addr, _, kind = item.strip().partition(" ")
        host, port = addr.rsplit(":", 1)
        out.append(Candidate(socket.gethostbyname(host), int(port), kind or "host"))
    return out


def publish_paths(store: Any, rank: int, paths: dict[int, str]) -> None:
    """``paths/RANK``: how ``rank`` reaches each peer, a ``PEER PATH`` line each (``HOST:PORT direct|relayed``,
    and the transport's name in a paired job), which ``erdma doctor`` reads."""
    store.set(f"paths/{rank}", "\n".join(f"{r} {p}" for r, p in sorted(paths.items())).encode())


def publish(cands: list[Candidate]) -> bytes:
    """What ``candidates`` reads back."""
    return ",".join(c.text() for c in cands).encode()
