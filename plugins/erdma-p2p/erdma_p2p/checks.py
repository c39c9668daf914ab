"""What erdma-p2p refuses before a rank contacts anyone (``register(..., check=)``, called on every rank when the
config is loaded): settings of ``[traversal.stun]`` and ``dht://`` URLs that cannot take effect, alone or with
the transport chosen. Nothing here resolves a name or touches the network (the factories do, at set-up)."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from erdma_core.sdk import ConfigError

DHT_FORM = "dht://HOST:PORT[,HOST:PORT...]/JOB"


def host_port(value: str) -> tuple[str, int] | None:
    """``HOST:PORT`` as (host, port), not resolved; None when it is not that."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def stun_server(value: str, key: str = "traversal.stun.server") -> tuple[str, int]:
    """A STUN (or TURN) server's ``HOST:PORT``, not resolved; ConfigError naming ``key`` otherwise."""
    found = host_port(value)
    if found is None:
        raise ConfigError(f"config key {key!r}: value {value!r} is not HOST:PORT (of a STUN server, e.g. "
                          "stun.example.org:3478; coturn serves STUN on 3478)")
    return found


def check_stun(config: Any, section: dict[str, Any]) -> None:
    """``traversal = "stun"``: a STUN server; a relay with its credentials; what the built-in TCP transport
    (which meets its peers from one mapped TCP port, ``tcp_socket``) cannot keep."""
    stun_server(section["server"])
    if section["relay"]:
        stun_server(section["relay"], "traversal.stun.relay")
        if not (section["relay_user"] and section["relay_password"]):
            raise ConfigError("config key 'traversal.stun.relay': a TURN server needs traversal.stun.relay_user and "
                              "traversal.stun.relay_password (its long-term credentials)")
    elif section.get("relay_over", "auto") in ("tcp", "tls"):
        raise ConfigError(f"config key 'traversal.stun.relay_over': value {section['relay_over']!r} needs "
                          "traversal.stun.relay (a TURN server); set it, or relay_over = 'auto'")
    ca = section.get("relay_ca", "")
    if ca and not os.path.isfile(ca):
        raise ConfigError(f"config key 'traversal.stun.relay_ca': value {ca!r} is not a file; valid: a PEM file of the "
                          "CA that signed the TURN server's certificate, or empty (the system's CAs)")
    if section["relay_when"] == "always" and not section["relay"]:
        raise ConfigError("config key 'traversal.stun.relay_when': value 'always' needs traversal.stun.relay "
                          "(a TURN server); set it, or relay_when = 'fallback'")
    transport = config["transport.name"] if config is not None else None  # (None: a traversal outside a job)
    fallback = config["transport.fallback"] if config is not None else "none"
    if section["relay"] and "quic" in (transport, fallback) and config["transport.quic.workers"]:
        raise ConfigError(f"config key 'transport.quic.workers': value {config['transport.quic.workers']} needs a "
                          "socket per lane, each in its worker process, and traversal.stun.relay gives every rank a "
                          "relay allocation on its data socket, whose client stays in this process; valid here: 0 "
                          "(or no relay)")
    if transport != "tcp":
        return
    if section["relay"] and fallback == "none":
        raise ConfigError(f"config key 'traversal.stun.relay': value {section['relay']!r} cannot be used with "
                          "transport.name = \"tcp\" alone: a TURN server relays datagrams, and the built-in TCP meets "
                          "its peers over TCP only; set transport.fallback = \"quic\" (TCP for the pairs that meet, "
                          "QUIC through the relay for the rest), or transport.name = \"quic\", or leave relay empty")
    if fallback != "none" and section["port"]:
        raise ConfigError(f"config key 'traversal.stun.port': value {section['port']} would be both the TCP port "
                          f"and the UDP port of a job with transport.fallback = {fallback!r}, whose candidates are "
                          "told apart by port; valid here: 0")
    if not section["punch"]:
        raise ConfigError("config key 'traversal.stun.punch': value False cannot be kept by transport.name = \"tcp\": "
                          "a rank behind a NAT opens it by connecting to its peer as the peer connects to it; valid "
                          "here: true")
    if config["transport.tcp.connections"] > 1:
        raise ConfigError(f"config key 'transport.tcp.connections': value {config['transport.tcp.connections']} "
                          "cannot take effect with traversal.name = \"stun\": a pair meets through its NATs from one "
                          "mapped port each, so it has one connection; valid here: 1")
    for key in ("port", "bind_address", "interface"):
        if config[f"transport.tcp.{key}"]:
            raise ConfigError(f"config key 'transport.tcp.{key}': value {config[f'transport.tcp.{key}']!r} is not "
                              "used with traversal.name = \"stun\" (traversal.stun.port and bind_address decide "
                              "where this rank meets its peers); leave it unset")


def bootstrap_nodes(url: str) -> tuple[list[tuple[str, int]], str]:
    """``(bootstrap HOST:PORTs, not resolved, job name)`` of a ``dht://`` URL; ConfigError naming the key."""
    parsed = urlparse(url)
    job = parsed.path.strip("/")
    if not parsed.netloc or not job:
        raise ConfigError(f"config key 'discovery.init_method': value {url!r} needs bootstrap nodes and a job name: "
                          f"{DHT_FORM} (the job name is the same on every rank, and new for each run)")
    nodes = []
    for item in parsed.netloc.split(","):
        found = host_port(item)
        if found is None:
            raise ConfigError(f"config key 'discovery.init_method': bootstrap node {item!r} in {url!r} is not "
                              f"HOST:PORT ({DHT_FORM})")
        nodes.append(found)
    return nodes, job


def check_dht(config: Any, section: dict[str, Any]) -> None:
    """``dht://``: a well-formed URL, and the secret its records are signed with."""
    bootstrap_nodes(config["discovery.init_method"])
    require_secret(config)


def require_secret(config: Any) -> None:
    """The dht:// discovery's records are signed with the job's secret: there must be one."""
    if config is None or not config["security.secret"]:
        raise ConfigError("config key 'security.secret': the dht:// discovery signs the job's records with it and "
                          "ignores records not signed with it; set the same secret on every rank (ERDMA_SECRET)")
