"""Entry point ``erdma.plugins: dpdk``: registers the ``dpdk`` transport and its ``erdma doctor`` lines.
Importing this module is cheap; DPDK (the C shim) loads only when the transport is chosen."""

from __future__ import annotations

from typing import Any

from erdma_core.sdk import Config, Option, PluginError, Register, hookimpl

from .backends import BACKENDS, check_options

OPTIONS = {
    "backend": Option(str, "memif", "the DPDK poll-mode driver: memif (shared-memory packet rings between "
                      "processes of one host, one per pair of ranks) or af_packet (a network interface, named by "
                      "`interface`)", choices=BACKENDS),
    "interface": Option(str, "", "af_packet: the network interface this rank sends and receives on; "
                        "{rank} is replaced by the rank (e.g. \"veth{rank}\")"),
    "frame_bytes": Option(int, 0, "bytes per packet, Ethernet and eRDMA headers included (0: 9000 for memif, "
                          "the interface's MTU + 14 for af_packet)", minimum=0, maximum=65000),
    "memif_buffer_bytes": Option(int, 0, "memif: bytes per ring buffer (memif's bsize; 0: frame_bytes). Must "
                                 "hold a whole frame", minimum=0, maximum=65535),
    "memif_ring_log2": Option(int, 10, "memif: log2 of the ring size in buffers", minimum=4, maximum=14),
    "memif_zero_copy": Option(bool, True, "memif: a rank's first client port (towards its lowest peer; DPDK "
                              "22.11 allows one per process) lends the ring its own packet buffers, so that memif "
                              "copies a byte once between the two processes, not twice (memif's zero-copy client "
                              "mode, over the EAL's memory shared as one file)"),
    "window": Option(int, 256, "packets per peer in flight (the receiver keeps this many for reordering; the "
                     "sender never has more unacknowledged)", minimum=8, maximum=16384),
    "descriptors": Option(int, 1024, "receive and transmit descriptors per port", minimum=64, maximum=16384),
    "rto_min_us": Option(int, 2000, "shortest retransmission timeout (it is 3 smoothed RTTs, doubling on every "
                         "timeout up to rto_max_us)", minimum=50),
    "rto_max_us": Option(int, 200_000, "longest retransmission timeout", minimum=100),
    "keepalive": Option(float, 1.0, "seconds of silence towards a peer after which an acknowledgement goes out "
                        "anyway", minimum=0.01),
    "peer_timeout": Option(float, 10.0, "seconds without a packet from a peer after which it counts as lost "
                           "(memif also notices at once when the peer's process closes its end)", minimum=0.1),
    "spin_us": Option(int, 50, "an idle poller yields the core this long before it sleeps between polls",
                      minimum=0),
    "poll_max_us": Option(int, 500, "longest sleep between two polls of idle ports", minimum=1),
    "eal_memory_mb": Option(int, 0, "memory DPDK reserves for the process (--no-huge -m; 0: enough for the first "
                            "process group's pools, at least 256)", minimum=0),
    "run_dir": Option(str, "", "where memif sockets go, one folder per job (empty: /run/erdma-dpdk as root, "
                      "else $XDG_RUNTIME_DIR/erdma-dpdk or /tmp/erdma-dpdk-UID)"),
    "inject_loss": Option(float, 0.0, "for testing recovery: the fraction of arriving data packets this rank "
                          "drops on purpose before looking at them", minimum=0.0, maximum=0.5),
}


def _factory(config: Config, section: dict[str, Any]) -> Any:
    check_options(section)
    try:
        from .transport import DpdkTransport
    except ImportError as exc:
        raise PluginError(f"transport 'dpdk' (erdma-dpdk) needs its C shim, which does not import here ({exc}): "
                          "install DPDK's headers (Debian/Ubuntu: apt-get install libdpdk-dev pkg-config) and "
                          "reinstall erdma-dpdk so that the shim is built") from None
    return DpdkTransport(config, section)


@hookimpl
def erdma_register_transports(register: Register) -> None:
    register("dpdk", _factory, options=OPTIONS,
             description="DPDK userspace packet I/O (memif, af_packet) with a reliable stream in C", sdk=2,
             check=lambda config, section: check_options(section))


@hookimpl
def erdma_doctor(config: Config) -> list[str]:
    from .doctor import report

    return report(config.section("transport.dpdk"), selected=config["transport.name"] == "dpdk")
