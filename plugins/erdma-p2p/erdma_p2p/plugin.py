"""Entry point ``erdma.plugins: p2p``: registers the ``stun`` traversal, the ``dht`` discovery and ``erdma dht``
(cheap to import)."""

from __future__ import annotations

from typing import Any

from erdma_core.sdk import Config, Option, Register, hookimpl

from .checks import check_dht, check_stun

OPTIONS = {
    "server": Option(str, "", "HOST:PORT of the STUN server asked for this rank's public mapping (coturn serves "
                     "STUN on 3478)"),
    "check_server": Option(str, "", "HOST:PORT of a second STUN server, at another address, that erdma doctor "
                           "also asks from the same socket: the two answers tell whether the NAT maps per "
                           "destination (a diagnostic: which path is used is decided by connecting); empty: not "
                           "tested"),
    "timeout": Option(float, 5.0, "seconds to wait for the STUN answer (requests are resent meanwhile)",
                      minimum=0.1, maximum=600.0),
    "bind_address": Option(str, "", "local address of the data socket; empty: every address"),
    "punch": Option(bool, True, "before a peer dials this rank, send it a datagram from the data socket so that "
                    "this rank's NAT lets the peer in; off: only ranks whose NAT lets anyone in are reachable directly (the "
                    "peer's permission on this rank's relay is asked for either way)"),
    "relay": Option(str, "", "HOST:PORT of a TURN server (coturn): every rank takes an allocation on it and offers "
                    "it as its last candidate, used by the peers that no direct path reaches; empty: no relay"),
    "relay_user": Option(str, "", "the TURN server's long-term credential: user name"),
    "relay_password": Option(str, "", "the TURN server's long-term credential: password", secret=True),
    "relay_over": Option(str, "auto", "how this rank talks to the TURN server: udp; tcp (every peer through the "
                         "relay, over one TCP connection to the server; for a site that drops UDP); tls (the same over "
                         "TLS to relay_tls_port, the server's certificate checked against relay_ca; for a site that "
                         "lets only TLS out); auto (UDP; TCP when the STUN server gives no answer over UDP within "
                         "timeout; TLS when no TCP connection to the relay's port is made either)",
                         choices=("auto", "udp", "tcp", "tls")),
    "relay_tls_port": Option(int, 5349, "the TURN server's TLS port (coturn's tls-listening-port), on the relay's "
                             "host: relay_over = 'tls', and 'auto' when TCP fails", minimum=1, maximum=65535),
    "relay_ca": Option(str, "", "a PEM file of the CA (or CAs) that signed the TURN server's TLS certificate, which "
                       "must name the relay's host; empty: the system's CAs"),
    "relay_when": Option(str, "fallback", "which paths go through the relay: those for which no direct candidate "
                         "answered within check_timeout (fallback), or every one (always)",
                         choices=("fallback", "always")),
    "check_timeout": Option(float, 2.0, "seconds a dialling rank waits for its first choice of a peer's "
                            "candidates before it takes the best other one that answered (over QUIC all are "
                            "checked at once; over TCP, the next is tried)",
                            minimum=0.1, maximum=600.0),
    "port": Option(int, 0, "local UDP port of the data socket; 0: any free one", minimum=0, maximum=65535),
    "classify_server": Option(str, "", "HOST:PORT of an RFC 3489 STUN server with two addresses (Debian's "
                              "stun-server, stund; coturn 4.6 does not answer RFC 3489 requests) against which erdma "
                              "doctor also runs pystun3's NAT classification (about 10-20 s, from a socket of its own; a "
                              "diagnostic: nothing is decided by it); empty: not run"),
}


DHT_OPTIONS = {
    "port": Option(int, 0, "local UDP port of this rank's DHT client node; 0: any free one", minimum=0, maximum=65535),
    "bind_address": Option(str, "", "local address of the DHT client node; empty: every address"),
    "rpc_timeout": Option(float, 1.0, "seconds to wait for a DHT node's answer (a dead node costs this much)",
                          minimum=0.05, maximum=60.0),
    "ttl": Option(float, 86400.0, "seconds the job's records live in the DHT (a crashed run's expire then)",
                  minimum=10.0, maximum=30 * 86400.0),
    "poll_max": Option(float, 0.5, "longest pause between two reads of a key that has not appeared",
                       minimum=0.01, maximum=60.0),
    "serve": Option(bool, False, "this rank's node also routes and stores for the others, as an erdma dht serve "
                    "node does (for a rank at an address the others reach, a port open to UDP): the job's records then "
                    "live on its ranks too, and the job goes on through them when every bootstrap node is gone"),
    "max_records": Option(int, 4096, "records a serving rank keeps in all (serve = true; 64 KiB at most each): past "
                          "it the oldest of the sending address holding the most goes", minimum=16, maximum=1_000_000),
    "per_source": Option(int, 512, "records a serving rank keeps from one sending address (serve = true): past it "
                         "that address's oldest goes", minimum=1, maximum=1_000_000),
}


def _dht(url: str, rank: int | None, world_size: int, timeout: float, config: Config) -> Any:
    from .dht_store import dht_store

    return dht_store(url, rank, world_size, timeout, config)


_dht.assigns_ranks = True  # type: ignore[attr-defined]  # a process given no rank claims one through the DHT


@hookimpl
def erdma_register_discovery(register: Register) -> None:
    register("dht", _dht, options=DHT_OPTIONS,
             description="a Kademlia DHT reached through bootstrap nodes (erdma dht serve): dht://HOST:PORT/JOB", sdk=2,
             check=check_dht)


@hookimpl
def erdma_add_commands(subparsers: Any) -> None:
    from .serve import add_parser  # argparse only: kademlia is imported when the command runs

    add_parser(subparsers)


@hookimpl
def erdma_doctor(config: Config) -> list[str]:
    from .doctor import job_paths, report

    lines = report(config.section("traversal.stun"))
    if config["discovery.init_method"].startswith("dht://"):
        lines += job_paths(config["discovery.init_method"], config["security.secret"],
                           config.section("discovery.dht"), config.section("traversal.stun")["timeout"])
    return lines


def _stun(config: Config | None, section: dict[str, Any]) -> Any:
    from .traversal import StunTraversal

    return StunTraversal(config, section)


@hookimpl
def erdma_register_traversals(register: Register) -> None:
    register("stun", _stun, options=OPTIONS,
             description="advertise the STUN-mapped address of the data socket, punch NATs open (erdma-quic; the "
                         "built-in TCP meets its peers from a mapped TCP port)", sdk=2, check=check_stun)
