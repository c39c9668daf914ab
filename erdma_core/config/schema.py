"""The core's config keys. Plugins add sections of their own through their ``register(..., options=)``."""

from __future__ import annotations

from .option import Option

COLLECTIVE_OPS = (
    "allreduce", "broadcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter", "alltoall", "barrier",
)


def core_schema(algorithms_for: dict[str, list[str]], kinds: dict[str, list[str]]) -> dict[str, dict[str, Option]]:
    """Return ``{section: {key: Option}}`` for the core, with choices drawn from what is registered."""

    def names(kind: str) -> list[str]:
        return sorted(kinds.get(kind, []))

    collectives: dict[str, Option] = {
        op: Option(str, "auto", f"algorithm for {op}, or 'auto' to choose by message size",
                   choices=["auto", *sorted(algorithms_for.get(op, []))])
        for op in COLLECTIVE_OPS
    }
    collectives |= {
        "small_message_bytes": Option(int, 65536, "allreduce inputs up to this size use halving_doubling, "
                                      "larger ones ring (when allreduce = 'auto')", minimum=0),
        "chunk_bytes": Option(int, 4 << 20, "largest message an algorithm sends in one piece; "
                              "larger slices are split and pipelined", minimum=1024),
        "ps_servers": Option(int, 1, "parameter_server: how many ranks serve shards", minimum=1),
    }
    return {
        "transport": {"name": Option(str, "tcp", "transport used between ranks", choices=lambda: names("transport"))},
        "discovery": {"init_method": Option(str, "env://", "rendezvous URL: env://, tcp://host:port, file://path")},
        "traversal": {"name": Option(str, "direct", "NAT traversal strategy", choices=lambda: names("traversal"))},
        "compression": {"name": Option(str, "none", "compressor applied to payloads",
                                       choices=lambda: names("compressor"))},
        "collectives": collectives,
        "timeouts": {
            "collective": Option(float, 300.0, "seconds any blocking collective may take", minimum=0.001),
            "connect": Option(float, 60.0, "seconds for rendezvous and connection set-up", minimum=0.001),
        },
        "security": {
            "job_token": Option(str, "", "shared secret; peers presenting another token are rejected "
                                "(empty: a random id chosen by rank 0 per job)"),
        },
    }
