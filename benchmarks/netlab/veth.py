"""Two network namespaces joined by one veth pair: ``eth0`` in each, 10.78.S.1 and 10.78.S.2, jumbo frames by
default. A kernel link between two "hosts" without the lab's relay (``topology.Lab``), for comparing the
kernel's TCP with a userspace packet path (erdma-dpdk's af_packet) over the same link. Root only; the
namespaces are deleted on exit.

    with VethPair() as pair:
        run_job("erdma-tcp", 2, bench_args, lab=pair)
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence


class VethPair:
    n = 2

    def __init__(self, mtu: int = 9000) -> None:
        self.mtu = mtu
        self.ranks = [f"erv{os.getpid()}-{i}" for i in range(2)]
        self.subnet = os.getpid() % 250

    def addr(self, i: int) -> str:
        return f"10.78.{self.subnet}.{i + 1}"

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ranks[i], *argv]

    def __enter__(self) -> VethPair:
        try:
            for ns in self.ranks:
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            a, b = self.ranks
            _ip("link", "add", "eth0", "netns", a, "type", "veth", "peer", "name", "eth0", "netns", b)
            for i, ns in enumerate(self.ranks):
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.eth0.disable_ipv6=1"],
                               check=True, timeout=30)
                _ip("-n", ns, "link", "set", "eth0", "mtu", str(self.mtu), "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.ranks:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
