"""The poll-mode drivers the transport drives, their device arguments, and the checks that turn a
setting DPDK would take badly (a silent loss, a device that ignores all its arguments) into an error that
names the key. No DPDK here: the transport calls these before it makes a port."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from erdma_core.sdk import ConfigError

BACKENDS = ("memif", "af_packet")
HEADERS = 14 + 40  # Ethernet, then the shim's header (``struct wire`` in shim.c)
ETHERNET = 14
MEMIF_FRAME = 9000
SYS_NET = pathlib.Path("/sys/class/net")


def _key(name: str) -> str:
    return f"transport.dpdk.{name}"


def check_options(o: dict[str, Any]) -> None:
    """What can be checked without DPDK and without knowing the rank."""
    if o["rto_max_us"] < o["rto_min_us"]:
        raise ConfigError(f"config key {_key('rto_max_us')!r}: {o['rto_max_us']} is below rto_min_us "
                          f"({o['rto_min_us']})")
    if o["backend"] == "memif":
        frame = o["frame_bytes"] or MEMIF_FRAME
        if o["memif_buffer_bytes"] and o["memif_buffer_bytes"] < frame:
            raise ConfigError(f"config key {_key('memif_buffer_bytes')!r}: bsize {o['memif_buffer_bytes']} < "
                              f"frame {frame} (transport.dpdk.frame_bytes): memif would split frames across "
                              "buffers, and loses and corrupts data once its ring fills; raise it or lower "
                              "frame_bytes")
        if o["interface"]:
            raise ConfigError(f"config key {_key('interface')!r}: {o['interface']!r} is for af_packet; "
                              "memif connects the ranks of one host through sockets, without an interface")
    elif not o["interface"]:
        raise ConfigError(f"config key {_key('interface')!r}: backend {o['backend']} needs a network interface "
                          f"(one of: {', '.join(interfaces()) or 'none here'}); {{rank}} is replaced by the rank")
    if o["frame_bytes"] and o["frame_bytes"] <= HEADERS:
        raise ConfigError(f"config key {_key('frame_bytes')!r}: {o['frame_bytes']} leaves no room for data after "
                          f"the {HEADERS} bytes of headers")


def interfaces() -> list[str]:
    try:
        return sorted(p.name for p in SYS_NET.iterdir())
    except OSError:
        return []


def interface_of(o: dict[str, Any], rank: int) -> str:
    return str(o["interface"]).replace("{rank}", str(rank))


def frame_of(o: dict[str, Any], iface: str | None) -> int:
    """The frame size for this rank: the option, or the backend's natural size; checked against the MTU."""
    if iface is None:
        return o["frame_bytes"] or MEMIF_FRAME
    mtu = int((SYS_NET / iface / "mtu").read_text())
    limit = mtu + ETHERNET
    frame = o["frame_bytes"] or limit
    if frame > limit:
        raise ConfigError(f"config key {_key('frame_bytes')!r}: frame {frame} > {limit}, the most interface "
                          f"{iface}'s MTU {mtu} carries with its Ethernet header; lower frame_bytes or raise the MTU")
    return frame


def check_interface(iface: str) -> None:
    where = SYS_NET / iface
    if not where.exists():
        raise ConfigError(f"config key {_key('interface')!r}: {iface!r} is not a network interface here "
                          f"(have: {', '.join(interfaces()) or 'none'})")
    flags = int((where / "flags").read_text(), 16)
    if not flags & 1:
        raise ConfigError(f"config key {_key('interface')!r}: interface {iface} is down (ip link set {iface} up)")
    if os.geteuid() != 0:
        raise ConfigError(f"config key {_key('backend')!r}: af_packet opens a raw socket on {iface}, "
                          "which needs root (or CAP_NET_RAW and CAP_NET_ADMIN)")


def memif_args(*, server: bool, socket: str, frame: int, o: dict[str, Any], secret: str,
               zero_copy: bool = False) -> str:
    bsize = o["memif_buffer_bytes"] or frame
    if bsize < frame:  # check_options said so already; this guards a frame size from elsewhere
        raise ConfigError(f"config key {_key('memif_buffer_bytes')!r}: bsize {bsize} < frame {frame}")
    # every argument memif knows, spelt as it expects: one it does not know makes it ignore all of them. Zero
    # copy is a client's mode only (the server copies as before); it needs the EAL's --single-file-segments
    return (f"id=0,role={'server' if server else 'client'},socket={socket},socket-abstract=no,bsize={bsize},"
            f"rsize={o['memif_ring_log2']},secret={secret},zero-copy={'yes' if zero_copy and not server else 'no'}")


def af_packet_frame(frame: int) -> int:
    """af_packet's ring frame for ``frame`` bytes: the frame, TPACKET2's header and alignment, a power of 2. The
    PMD wants mbufs that hold a whole ring frame less 32 bytes: the pool's buffers are this large."""
    return 1 << max(11, (frame + 128 - 1).bit_length())


def af_packet_args(iface: str, frame: int, descriptors: int) -> str:
    framesz = af_packet_frame(frame)
    blocksz = max(framesz, 4096)
    return f"iface={iface},qpairs=1,blocksz={blocksz},framesz={framesz},framecnt={descriptors + descriptors % 2},qdisc_bypass=0"


def buffer_of(backend: str, frame: int) -> int:
    """Bytes of data per mbuf in the pool (at least a frame): af_packet wants room for its whole ring frame."""
    return af_packet_frame(frame) if backend == "af_packet" else frame
