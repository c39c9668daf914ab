"""``[algorithm.allreduce.naca]``: the options of the naca algorithm (broadcast and reduce_scatter through
naca read the same section), checked into ``Settings`` once per group."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from erdma_core.sdk import ConfigError, Option

from . import header as H

SECTION = "algorithm.allreduce.naca"
AUTO_MAX_BYTES, AUTO_MIN_RANKS = 16 << 10, 8  # where the lab measured the node path faster: README.md, "Measured"
OPTIONS = {
    "nodes": Option(str, "", "aggregation nodes, host:port, comma-separated in failover order (the environment "
                    "variable ERDMA_NACA_NODES, when set, replaces it); empty: every naca collective runs the "
                    "host algorithm"),
    "secret_file": Option(str, "", "file holding the nodes' admission secret (the one `erdma naca serve "
                          "--secret-file` reads); required when nodes are named"),
    "chunk_bytes": Option(int, 8192, "payload bytes per datagram (one slot's chunk); above the path MTU the "
                          "datagrams are fragmented by IP", minimum=64, maximum=H.MAX_DATAGRAM - 256),
    "slots": Option(int, 128, "slots the job asks each node for: chunks in flight (the node may grant fewer)",
                    minimum=1, maximum=65535),
    "inflight_bytes": Option(int, 1 << 20, "payload bytes a rank has unanswered at most (chunks in flight: this "
                             "over chunk_bytes, at least 2, at most the slots granted); more than the node's and the "
                             "ranks' socket buffers hold is dropped and sent again", minimum=1024, maximum=1 << 30),
    "fallback": Option(str, "ring", "allreduce's host algorithm when no node can serve (broadcast uses tree, "
                       "reduce_scatter ring)", choices=("ring", "halving_doubling", "recursive_doubling", "tree",
                                                        "parameter_server")),
    "join_timeout": Option(float, 1.0, "seconds to wait for a node to accept the job", minimum=0.01,
                           maximum=600.0),
    "node_timeout": Option(float, 2.0, "seconds without any datagram from the node, while waiting for it, "
                           "after which it is taken for dead and the ranks fail over", minimum=0.05,
                           maximum=3600.0),
    "rto_min_ms": Option(float, 200.0, "shortest retransmission timeout (SRTT + 4 RTTVAR, doubling per retry)",
                         minimum=0.1, maximum=60000.0),
    "rto_max_ms": Option(float, 1000.0, "longest retransmission timeout, and the first one before an RTT is "
                         "measured", minimum=1.0, maximum=60000.0),
    "reprobe_after": Option(int, 64, "collectives a group runs on the hosts (its nodes did not take it, or it "
                            "failed over to the hosts) before its ranks try the nodes again; twice as many after "
                            "each try that finds none, up to 64 times this", minimum=1, maximum=1 << 30),
    "auto_max_bytes": Option(int, AUTO_MAX_BYTES, "with [collectives] allreduce = auto and nodes named: an "
                             "allreduce of at most this many bytes (each rank's input), in a group of at least "
                             "auto_min_ranks, goes through the nodes; the others take the core's choice (the "
                             "plugin's README, \"Measured\", says where the node path wins and loses); 0: auto never "
                             "picks naca", minimum=0, maximum=1 << 40),
    "auto_min_ranks": Option(int, AUTO_MIN_RANKS, "with auto: the smallest group whose allreduces of at most "
                             "auto_max_bytes go through the nodes", minimum=2, maximum=H.MAX_RANKS),
    "inject_loss": Option(float, 0.0, "drop this fraction of the datagrams this rank sends and receives "
                          "(testing)", minimum=0.0, maximum=0.5),
}
ENVIRONMENT = {"ERDMA_NACA_NODES": "aggregation nodes of the naca algorithm, host:port,... (replaces "
                                   "[algorithm.allreduce.naca] nodes)"}


class Settings(NamedTuple):
    nodes: tuple[str, ...]
    addresses: tuple[tuple[str, int], ...]
    admission: bytes
    chunk_bytes: int
    slots: int
    inflight_bytes: int
    fallback: str
    join_timeout: float
    node_timeout: float
    rto_min: float
    rto_max: float
    reprobe_after: int
    inject_loss: float


def parse_nodes(text: str, where: str) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    names, addrs = [], []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{where}: {item!r} is not host:port (e.g. 10.0.0.5:7700)")
        names.append(item)
        addrs.append((host.strip("[]"), int(port)))
    return tuple(names), tuple(addrs)


def named_nodes(section: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The nodes' text (host:port,...) and where it was read: ERDMA_NACA_NODES when set, else the option."""
    environ = os.environ if environ is None else environ
    if environ.get("ERDMA_NACA_NODES"):  # (empty: unset, as for every ERDMA_ variable)
        return environ["ERDMA_NACA_NODES"], "ERDMA_NACA_NODES"
    return section["nodes"], SECTION + ".nodes"


def settings(section: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Settings:
    text, where = named_nodes(section, environ)
    nodes, addrs = parse_nodes(text, f"{where}={text!r}")
    admission = b""
    if nodes:
        path = section["secret_file"]
        if not path:
            raise ConfigError(f"{SECTION}.secret_file is empty; naca nodes ({', '.join(nodes)}) need the file "
                              "holding their admission secret")
        try:
            admission = H.admission_key(H.read_secret(path))
        except ValueError as exc:
            raise ConfigError(f"{SECTION}.secret_file={path!r}: {exc}") from None
    if section["rto_max_ms"] < section["rto_min_ms"]:
        raise ConfigError(f"{SECTION}.rto_max_ms={section['rto_max_ms']} is below rto_min_ms={section['rto_min_ms']}")
    return Settings(nodes, addrs, admission, section["chunk_bytes"], section["slots"],
                    section["inflight_bytes"], section["fallback"],
                    section["join_timeout"], section["node_timeout"], section["rto_min_ms"] / 1e3,
                    section["rto_max_ms"] / 1e3, section["reprobe_after"], section["inject_loss"])
