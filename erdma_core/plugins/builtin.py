"""The core's own components, registered through the same hooks as any external plugin. (The core's own
commands are the command line's, not a plugin's: ``erdma_core.cli.main`` adds them itself.)"""

from __future__ import annotations

from typing import Any

from ..algorithms import (
    alltoall,
    direct,
    halving_doubling,
    parameter_server,
    recursive_doubling,
    ring,
    scatter_allgather,
    tree,
)
from ..config.option import Option
from ..protocol.config import Config
from ..protocol.ops import OPS
from .hookspecs import Register, RegisterAlgorithm, RegisterEnvironment, hookimpl


def _tcp(config: Config, section: dict[str, Any]) -> Any:
    from ..transport.tcp import TcpTransport

    return TcpTransport(config, section)


TCP_OPTIONS = {
    "bind_address": Option(str, "", "address to listen on; empty: the address that routes to the discovery "
                           "host (127.0.0.1 on loopback)"),
    "interface": Option(str, "", "network interface whose IPv4 address to use (overrides bind_address)"),
    "port": Option(int, 0, "port to listen on; 0 picks a free one", minimum=0, maximum=65535),
    "nodelay": Option(bool, True, "set TCP_NODELAY"),
    "keepalive": Option(bool, True, "set SO_KEEPALIVE (a probe after 10 s idle, then every 5 s); either way a "
                        "connection is given up only when it went unanswered for timeouts.collective "
                        "(TCP_USER_TIMEOUT)"),
    "socket_buffer_bytes": Option(int, 4 << 20, "SO_SNDBUF/SO_RCVBUF; 0 keeps the kernel's", minimum=0,
                                  maximum=1 << 30),
    "spin_us": Option(int, 200, "microseconds a rank waiting for a message polls its sockets (yielding the core "
                      "between polls) before it sleeps; a sleeping rank is woken by the kernel, which costs more "
                      "than a small message; 0: sleep at once", minimum=0, maximum=1_000_000),
    "local_sockets": Option(bool, True, "ranks on the same host and network namespace connect over a Unix-domain "
                            "socket instead of TCP"),
    "single_copy_bytes": Option(int, 1 << 20, "between ranks on one host that may read each other's memory "
                                "(same user, ptrace allowed: tried at set-up), messages of at least this many bytes "
                                "are read by the receiver straight from the sender's memory (process_vm_readv), one "
                                "copy instead of two through a Unix socket; 0: always through the socket",
                                minimum=0, maximum=1 << 40),
    "connections": Option(int, 1, "TCP connections per pair of ranks on different hosts (a pool): each data "
                          "frame of 64 KiB or more goes to the one with the fewest bytes waiting, so the chunks of a "
                          "collective's messages (collectives.chunk_bytes) travel side by side and one flow's window "
                          "does not cap a long, fat link (window / RTT per flow); the same on every rank. Ranks of "
                          "one host (Unix sockets) use one; a traversal that meets peers through NATs allows only 1",
                          minimum=1, maximum=64),
    "congestion": Option(str, "auto", "congestion controller of every TCP data connection (TCP_CONGESTION): "
                         "auto: bbr where the kernel offers it (a loss does not halve its rate, as it does cubic's, "
                         "most hosts' default), else the host's default (said once at INFO); host: the host's "
                         "default; or a name from /proc/sys/net/ipv4/tcp_available_congestion_control"),
    "tls": Option(bool, False, "encrypt every TCP connection with TLS 1.3 (the standard library's ssl), bound to "
                  "the job's secret, instead of sealing each frame in the clear (frames are sealed either way); "
                  "Unix sockets between ranks of one host stay plaintext"),
}


@hookimpl
def erdma_register_transports(register: Register) -> None:
    register("tcp", _tcp, options=TCP_OPTIONS,
             description="TCP connections between rank pairs (one, or a pool of them), zero-copy receive", sdk=2)


@hookimpl
def erdma_register_discovery(register: Register) -> None:
    from .. import discovery
    from ..discovery import etcd

    register("env", discovery.env_store, description="MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, as torchrun sets", sdk=2)
    register("tcp", discovery.tcp_store, description="key-value store served by rank 0 at tcp://host:port", sdk=2,
             check=discovery.check_tcp)
    register("file", discovery.file_store, description="key-value store in a shared folder, file:///path", sdk=2,
             check=discovery.check_file)
    register("etcd", discovery.etcd_store, options=etcd.OPTIONS,
             description="key-value store on an etcd cluster, etcd://host:port[,host:port...]/prefix", sdk=2)


@hookimpl
def erdma_register_traversals(register: Register) -> None:
    from ..traversal import DirectTraversal

    register("direct", DirectTraversal, description="no NAT traversal: dial the listening address", sdk=2)


@hookimpl
def erdma_register_compressors(register: Register) -> None:
    from ..compression import NoCompression

    register("none", NoCompression, description="payloads sent as they are", sdk=2)


@hookimpl
def erdma_register_algorithms(register: RegisterAlgorithm) -> None:
    register("allreduce", "ring", ring.allreduce, description="reduce-scatter + allgather ring, chunked", sdk=2)
    register("allreduce", "halving_doubling", halving_doubling.allreduce,
             description="recursive halving/doubling (Rabenseifner), any world size", sdk=2)
    register("allreduce", "recursive_doubling", recursive_doubling.allreduce,
             description="log2(p) full exchanges: fewest steps, for small messages", sdk=2)
    register("allreduce", "tree", tree.allreduce, description="binomial reduce then binomial broadcast", sdk=2)
    register("allreduce", "parameter_server", parameter_server.allreduce, options=PS_OPTIONS,
             description="push to shard servers, reduce, pull", sdk=2)
    register("broadcast", "tree", tree.broadcast, description="binomial tree", sdk=2)
    register("broadcast", "scatter_allgather", scatter_allgather.broadcast,
             description="root scatters a slice to each rank, then a ring allgather (large messages, 3+ ranks)", sdk=2)
    register("reduce", "tree", tree.reduce, description="binomial tree", sdk=2)
    register("allgather", "ring", ring.allgather, description="ring", sdk=2)
    register("allgather", "recursive_doubling", recursive_doubling.allgather,
             description="log2(p) exchanges, doubling: fewest steps, for small messages", sdk=2)
    register("reduce_scatter", "ring", ring.reduce_scatter, description="ring", sdk=2)
    register("reduce_scatter", "recursive_halving", recursive_doubling.reduce_scatter,
             description="log2(p) exchanges, halving: fewest steps, for small messages", sdk=2)
    register("gather", "direct", direct.gather, description="root receives from every rank", sdk=2)
    register("scatter", "direct", direct.scatter, description="root sends to every rank", sdk=2)
    register("alltoall", "pairwise", alltoall.pairwise, description="p-1 steps of pairwise exchange", sdk=2)
    register("alltoall", "linear", alltoall.linear,
             description="one step: all blocks sent and received at once (fewest waits, small messages)", sdk=2)
    register("alltoall", "sequential", alltoall.sequential,
             description="one pair at a time in strict order (lowest peak memory)", sdk=2)
    register("barrier", "dissemination", direct.barrier, description="log2(p) rounds of zero-byte messages", sdk=2)


PS_OPTIONS = {"servers": Option(int, 1, "how many ranks serve shards (rank i serves shard i)", minimum=1)}
ENVIRONMENT = {
    "ERDMA_CONFIG": "path of the config file (default: ./erdma.toml when present)",
    "ERDMA_PLUGINS": "comma list: load only these external plugins (a name no installed plugin has is an error)",
    "ERDMA_DISABLE_PLUGINS": "comma list: do not load these plugins",
    "ERDMA_TRACE_PLUGINS": "1: log every hook call to stderr",
    "ERDMA_DEBUG": "INFO, DEBUG, WARNING or ERROR: the library's log lines at that level and above on stderr, with "
                   "no change to the program (as NCCL_DEBUG=INFO); empty: the program's logging decides",
}


@hookimpl
def erdma_register_environment(register: RegisterEnvironment) -> None:
    for name, description in ENVIRONMENT.items():
        register(name, description)


@hookimpl(trylast=True)
def erdma_choose_algorithm(op: str, nbytes: int, world_size: int, config: Config) -> str | None:
    """The core's 'auto' policy, which the README's "Algorithms" section states for users (one statement of
    it there; the options' help points to it)."""
    if op == "allreduce" and nbytes <= config["collectives.tiny_message_bytes"]:
        return "recursive_doubling"
    if op == "allreduce" and nbytes <= config["collectives.small_message_bytes"]:
        return "halving_doubling"
    small = nbytes * world_size <= config["collectives.tiny_message_bytes"]  # the whole buffer: p blocks
    if op == "allgather" and small:
        return "recursive_doubling"
    if op == "reduce_scatter" and small:
        return "recursive_halving"
    if op == "broadcast" and world_size > 2 and nbytes > config["collectives.small_message_bytes"]:
        return "scatter_allgather"
    if op == "alltoall" and world_size > 2:  # up to small_message_bytes one wait, not p-1; pairwise above
        return "linear" if nbytes <= config["collectives.small_message_bytes"] else "pairwise"
    info = OPS.get(op)
    return info.default if info is not None else None
