"""The core's config keys. Plugins add sections of their own through their ``register(..., options=)``."""

from __future__ import annotations

from ..protocol.ops import COLLECTIVES
from .option import Option

MAX_TIMEOUT = 7 * 24 * 3600.0  # a week: longer waits are a mistake (and overflow the clocks they are added to)


def core_schema(algorithms_for: dict[str, list[str]], kinds: dict[str, list[str]]) -> dict[str, dict[str, Option]]:
    """Return ``{section: {key: Option}}`` for the core, with choices drawn from what is registered."""
    def names(kind: str) -> list[str]:
        return sorted(kinds.get(kind, []))

    collectives: dict[str, Option] = {
        op: Option(str, "auto", f"algorithm for {op}, or 'auto': chosen by message size and world size (README, "
                   "\"Algorithms\")",
                   choices=["auto", *sorted(algorithms_for.get(op, []))])
        for op in COLLECTIVES
    }
    collectives |= {
        "tiny_message_bytes": Option(int, 65536, "with 'auto': the size up to which the algorithms with the "
                                     "fewest steps are chosen (README, \"Algorithms\")", minimum=0),
        "small_message_bytes": Option(int, 1 << 20, "with 'auto': the size up to which the algorithms for "
                                      "middle sizes are chosen, above it those for large messages (README, "
                                      "\"Algorithms\")", minimum=0),
        "chunk_bytes": Option(int, 4 << 20, "largest message an algorithm sends in one piece; "
                              "larger slices are split and pipelined", minimum=1024),
    }
    return {
        "transport": {
            "name": Option(str, "tcp", "transport used between ranks", choices=lambda: names("transport")),
            "fallback": Option(str, "none", "a second transport for the pairs of ranks the first cannot connect "
                               "within one check of their candidates (with the built-in TCP meeting peers through "
                               "NATs, traversal.name = \"stun\": quic, which also reaches them through "
                               "traversal.stun.relay); none: every pair on transport.name",
                               choices=lambda: ("none", *names("transport"))),
        },
        "discovery": {"init_method": Option(str, "env://", "discovery URL, as torch's init_method: env://, "
                                            "tcp://host:port, file:///path, etcd://host:port[,host:port...]/prefix; "
                                            "its scheme picks the discovery method")},
        "traversal": {"name": Option(str, "direct", "NAT traversal strategy", choices=lambda: names("traversal"))},
        "compression": {
            "name": Option(str, "none", "compressor applied to the messages of collectives",
                           choices=lambda: names("compressor")),
            "min_bytes": Option(int, 1024, "messages smaller than this (raw bytes) are sent raw (so DDP's buckets, "
                                "FSDP's gradient shards and a small model's pseudo-gradients are compressed, and "
                                "a bias of a few hundred floats may not be)", minimum=0),
            "ops": Option(str, "auto", "collectives whose messages are compressed: auto (a lossy compressor: the "
                          "reductions allreduce, reduce and reduce_scatter, which carry gradients, while parameters "
                          "and data travel raw; a lossless one: every collective), all, or a comma-separated list "
                          "of collectives"),
            "policy": Option(str, "always", "always: encode every message the settings above select; auto: per "
                             "message, only when the time its saved bytes would take on the link (the transport's "
                             "measured rate to that peer) exceeds the codec's measured encode and decode time",
                             choices=("always", "auto")),
            "pipeline": Option(bool, False, "encode the next message of a step on a helper thread while the "
                               "current one is sent (a GPU compressor encodes there on a CUDA stream of its own); "
                               "false: each message is encoded just before it is sent (erdma-gpucomp's README "
                               "says when the helper thread pays)"),
        },
        "collectives": collectives,
        "elastic": {
            "job": Option(str, "default", "name of the elastic job a peer joins (``erdma_core.elastic.join``)"),
            "min_peers": Option(int, 1, "peers that must have joined before an elastic job starts (`erdma run "
                                "--elastic -n N` sets N); the job's is the first value written (the launcher's, "
                                "else the first peer's): a peer left at the default follows it, one given "
                                "another is refused", minimum=1, maximum=1 << 16),
            "join_timeout": Option(float, 600.0, "seconds a peer waits to be admitted to an elastic job",
                                   minimum=0.001, maximum=MAX_TIMEOUT),
            "admission_check": Option(bool, True, "before a newcomer is put into an epoch, it and each member of the "
                                      "latest epoch check that they connect (a group of two per pair, through the "
                                      "job's transport and traversal, set up on threads beside the members' steps); "
                                      "one that cannot says which pairs and checks again later, until join_timeout. "
                                      "false: it is put in at once, and a newcomer that cannot reach the members "
                                      "costs them timeouts.connect"),
            "liveness_timeout": Option(float, 5.0, "seconds without a member's sign of life in the job's store "
                                       "(a counter each member bumps every quarter of this; on etcd every eighth, "
                                       "heard through a watch, in a key under a lease of this many seconds, at "
                                       "least etcd's minimum) after which the others count it out, ending the "
                                       "collective or the set-up that waits on it; 0: off (a hung member is then "
                                       "found at timeouts.collective)", minimum=0.0,
                                       maximum=MAX_TIMEOUT),
        },
        "timeouts": {
            "collective": Option(float, 300.0, "seconds any blocking collective may take", minimum=0.001,
                                 maximum=MAX_TIMEOUT),
            "connect": Option(float, 60.0, "seconds for discovery and connection set-up", minimum=0.001,
                              maximum=MAX_TIMEOUT),
        },
        "security": {
            "secret": Option(str, "", "the job's shared secret: every connection a rank accepts (store and "
                             "transport) must prove it knows it; the same on every rank (`erdma run` makes one "
                             "per job). Empty: connections prove nothing, and a rank listening on a non-loopback "
                             "address warns", secret=True),
            "require_secret": Option(bool, False, "refuse to start without security.secret"),
            "max_early_bytes": Option(int, 1 << 30, "bytes a rank holds per peer for messages that arrived "
                                      "before their receive was posted; a peer that sends more is an error",
                                      minimum=1 << 16, maximum=1 << 40),
        },
    }
