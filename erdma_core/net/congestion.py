"""Which congestion controller the built-in TCP's data connections run (``transport.tcp.congestion``), set per
socket with ``TCP_CONGESTION`` rather than left to the host's default.

Most Linux hosts default to cubic, which halves its window at each loss: in the benchmark lab, with cubic hosts,
a 4-rank 16 MiB allreduce over TCP on ``lossy`` (1% loss, 100 Mbit/s, 40 ms) took 72.2 s on the hosts' cubic and
2.8 s on BBR (docs/benchmarks.md, "The built-in TCP's congestion controller"). ``auto`` (the default) picks BBR where the
kernel offers it (listed in ``/proc/sys/net/ipv4/tcp_available_congestion_control``, or loadable: a process with
CAP_NET_ADMIN loads ``tcp_bbr`` by asking for it) and otherwise keeps the host's default, saying so once at INFO;
``host`` always keeps the host's; any other value names a controller, which must be available.
"""

from __future__ import annotations

import functools
import logging
import socket
from pathlib import Path

from ..errors import ConfigError

log = logging.getLogger("erdma.transport")
PROC = Path("/proc/sys/net/ipv4")
PREFERRED = "bbr"


def available() -> list[str]:
    """The controllers the kernel has loaded (empty where there is no such list: not Linux)."""
    try:
        return (PROC / "tcp_available_congestion_control").read_text().split()
    except OSError:
        return []


def host_default() -> str:
    try:
        return (PROC / "tcp_congestion_control").read_text().strip()
    except OSError:
        return "unknown"


@functools.cache
def usable(name: str) -> bool:
    """Whether a socket of this process can run ``name`` (trying it loads its module when this process may)."""
    if not hasattr(socket, "TCP_CONGESTION"):
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
        except OSError:
            return False
        return probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode() == name


@functools.cache
def choose(setting: str) -> str | None:
    """The controller to set on every data connection for ``setting``, or None for the host's default."""
    if setting == "host":
        return None
    if setting == "auto":
        if usable(PREFERRED):
            log.info("TCP congestion control: %s on erdma's TCP connections (transport.tcp.congestion = auto; the "
                     "host's default is %s)", PREFERRED, host_default())
            return PREFERRED
        log.info("TCP congestion control: this kernel offers no %s (available: %s); erdma's TCP connections run "
                 "the host's default, %s (transport.tcp.congestion = auto)", PREFERRED,
                 " ".join(available()) or "none listed", host_default())
        return None
    if usable(setting):
        return setting
    raise ConfigError(f"config key 'transport.tcp.congestion': {setting!r} is not a congestion controller this "
                      f"kernel offers; valid: auto, host, {', '.join(available()) or '(none listed)'}")


def describe(setting: str) -> str:
    """One line for ``erdma doctor``."""
    try:
        chosen = choose(setting)
    except ConfigError as exc:
        return f"problem: {exc}"
    runs = chosen or f"the host's default, {host_default()}"
    return (f"TCP congestion control: {runs} on erdma's TCP connections (transport.tcp.congestion = {setting}; "
            f"the kernel offers {' '.join(available()) or 'none listed'})")
