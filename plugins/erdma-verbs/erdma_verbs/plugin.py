"""Entry point ``erdma.plugins: verbs``: registers the ``verbs`` transport and its ``erdma doctor`` lines.
Importing this module is cheap; libibverbs loads only when the transport is chosen."""

from __future__ import annotations

from typing import Any

from erdma_core.sdk import Config, ConfigError, Option, PluginError, Register, hookimpl
from erdma_core.toolkit import FRAME

OPTIONS = {
    "device": Option(str, "", "RDMA device (e.g. mlx5_0, rxe0); empty: the first the host has"),
    "port": Option(int, 1, "port of the device", minimum=1, maximum=255),
    "gid_index": Option(int, -1, "GID index; -1: the port's first RoCEv2 GID on an IPv4 address", minimum=-1),
    "slots": Option(int, 16, "receive buffers per peer a sender may write into before the receiver frees "
                    "them (writes in flight per peer)", minimum=2, maximum=4096),
    "slot_bytes": Option(int, 256 << 10, "bytes per receive buffer: a message is written in pieces this large",
                         minimum=4096, maximum=(1 << 24) - 1),
    "zero_copy_bytes": Option(int, 64 << 10, "payloads at least this large are written from the caller's memory "
                              "(registered once, cached); smaller ones are copied into registered send buffers",
                              minimum=0),
    "registration_cache_bytes": Option(int, 1 << 30, "bytes of caller memory kept registered (and alive) for "
                                       "later sends, least recently used dropped first", minimum=0),
    "completion": Option(str, "poll", "how the I/O thread waits for completions: poll (with back-off up to "
                         "poll_max_us; lowest latency) or channel (sleeps on a completion channel; no polling)",
                         choices=("poll", "channel")),
    "poll_max_us": Option(int, 500, "longest pause between two polls of an idle completion queue", minimum=1),
    "spin_us": Option(int, 50, "a thread waiting for a message polls this long (yielding the core between polls) "
                      "before it starts to sleep between polls", minimum=0),
    "qp_timeout": Option(int, 18, "queue-pair ACK timeout exponent (4.096 us * 2^n; 18 ~ 1.07 s): how long a "
                         "write waits for its ACK before it is sent again", minimum=1, maximum=31),
    "retry_count": Option(int, 6, "resends of an unacknowledged write before the peer counts as lost (at most 6: "
                          "SoftRoCE takes 7 to mean without limit, and a dead peer would never be noticed)",
                          minimum=0, maximum=6),
    "native": Option(bool, True, "collectives of the job's whole world without a reduction (all-to-all, all-gather, "
                     "broadcast, scatter, gather) or with one on integers, or a sum, average or product of float32 "
                     "or float64, run whole in compiled code over queue pairs of their own (steps.c); false: every "
                     "collective goes message by message through the core's executor"),
    "native_reduce_bytes": Option(int, 0, "largest reduction (bytes of its data) the compiled path runs; larger "
                                  "ones go through the message path, which sends them from the caller's memory "
                                  "(0: a ring's worth, slots x slot_bytes)", minimum=0),
    "keepalive": Option(float, 1.0, "seconds of silence towards a peer after which a keepalive is sent (a dead "
                        "peer is noticed once it goes unanswered: about qp_timeout * (retry_count + 1) later)",
                        minimum=0.05),
}


HEADER_BYTES = FRAME.size  # the core's frame header, which a slot carries too


def _check(config: Config, section: dict[str, Any]) -> None:
    if HEADER_BYTES + section["zero_copy_bytes"] > section["slot_bytes"]:
        raise ConfigError(f"config key 'transport.verbs.zero_copy_bytes': {section['zero_copy_bytes']} plus the "
                          f"{HEADER_BYTES}-byte header must fit in transport.verbs.slot_bytes ({section['slot_bytes']})"
                          "; lower it, or raise slot_bytes")


def _factory(config: Config, section: dict[str, Any]) -> Any:
    _check(config, section)
    try:
        from .transport import VerbsTransport
    except ImportError as exc:
        raise PluginError(f"transport 'verbs' (erdma-verbs) needs its C side over libibverbs, which does not import "
                          f"here ({exc}): install rdma-core's libibverbs-dev (Debian/Ubuntu: apt-get install "
                          "libibverbs-dev) and reinstall erdma-verbs, which builds it") from None
    return VerbsTransport(config, section)


@hookimpl
def erdma_register_transports(register: Register) -> None:
    register("verbs", _factory, options=OPTIONS,
             description="RDMA verbs (libibverbs): an RC queue pair per peer, RDMA WRITE with immediate, credits", sdk=2,
             check=_check)


@hookimpl
def erdma_doctor(config: Config) -> list[str]:
    from .doctor import report

    return report(config.section("transport.verbs"), selected=config["transport.name"] == "verbs")
