"""A NAT test bed from network namespaces: a public segment (a bridge in namespace ``pub``, 198.51.100.0/24)
with coturn at 198.51.100.1:3478 (and .2, for the mapping test) serving STUN, and TURN for user ``TURN_USER``
(long-term credentials; relayed addresses on the same segment; also over TCP on 3478 and TLS on 5349, its
certificate signed by a CA made at the start, ``NatLab.turn_ca``), stund (RFC 3489, both addresses) at port
3490 for pystun3's classification, and sites:
each a NAT router (WAN 198.51.100.1x, nftables masquerade, unsolicited inbound on the WAN dropped, as a home
router does) with one private host behind it (10.<site>.0.2), or a host on the public segment itself.
Everything is removed on exit, also after a failure.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import certs

STUN = ("198.51.100.1", 3478)
STUN_CHECK = ("198.51.100.2", 3478)  # the same coturn at its second address (erdma doctor's mapping test)
TURN_USER, TURN_PASSWORD = "erdma", "relay-test-password"
TURN_TLS_PORT = 5349  # coturn's TLS listener, its certificate signed by the bed's CA (``NatLab.turn_ca``)
RFC3489 = (STUN[0], 3490)  # stund (Debian's stun-server), on both addresses: pystun3's classification


def available() -> str | None:
    """Why the bed cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "nft", "turnserver", "stund"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/system-deps.sh test installs it)"
    return None


def sh(*cmd: str, ns: str | None = None) -> str:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    out = subprocess.run(full, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(full)}: {out.stderr.strip()}")
    return out.stdout


def first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The first line ``proc`` prints, or "" if none comes within ``timeout`` seconds (it is then killed)."""
    assert proc.stdout is not None
    if select.select([proc.stdout], [], [], timeout)[0]:
        return proc.stdout.readline()
    proc.kill()
    return ""


class NatLab:
    def __init__(self, sites: int, tmp: Path, symmetric: frozenset[int] = frozenset(),
                 public: frozenset[int] = frozenset()) -> None:
        """``symmetric``: sites whose NAT maps each destination to a new port (masquerade fully-random);
        ``public``: sites with no NAT (the host sits on the public segment at the site's WAN address)."""
        self.p = f"n{os.getpid() % 10000}"
        self.sites, self.tmp, self.symmetric, self.public = sites, tmp, symmetric, public
        self.namespaces: list[str] = []
        self.stun: subprocess.Popen[bytes] | None = None
        self.turn_ca = tmp / "turn-ca.pem"  # the CA that signed coturn's TLS certificate (written at start)

    def ns(self, name: str) -> str:
        return f"{self.p}{name}"

    def host(self, site: int) -> str:
        return self.ns(f"h{site}")

    def wan(self, site: int) -> str:
        return f"198.51.100.{10 + site}"

    def __enter__(self) -> NatLab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, name: str) -> str:
        ns = self.ns(name)
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        sh("ip", "link", "set", "lo", "up", ns=ns)
        return ns

    def _build(self) -> None:
        pub = self._add("pub")
        sh("ip", "link", "add", "br0", "type", "bridge", ns=pub)
        sh("ip", "addr", "add", "198.51.100.1/24", "dev", "br0", ns=pub)
        sh("ip", "addr", "add", "198.51.100.2/24", "dev", "br0", ns=pub)  # STUN_CHECK
        sh("ip", "link", "set", "br0", "up", ns=pub)
        for i in range(self.sites):
            if i in self.public:
                self._public_host(pub, i)
                continue
            router, host = self._add(f"r{i}"), self._add(f"h{i}")
            wan, wan_peer, lan, lan_peer = (f"{self.p}{x}{i}" for x in ("w", "W", "l", "L"))
            sh("ip", "link", "add", wan, "type", "veth", "peer", "name", wan_peer)
            sh("ip", "link", "set", wan, "netns", router, "name", "wan0")
            sh("ip", "link", "set", wan_peer, "netns", pub)
            sh("ip", "link", "set", wan_peer, "master", "br0", "up", ns=pub)
            sh("ip", "link", "add", lan, "type", "veth", "peer", "name", lan_peer)
            sh("ip", "link", "set", lan, "netns", router, "name", "lan0")
            sh("ip", "link", "set", lan_peer, "netns", host, "name", "eth0")
            sh("ip", "addr", "add", f"{self.wan(i)}/24", "dev", "wan0", ns=router)
            sh("ip", "addr", "add", f"10.{i + 1}.0.1/24", "dev", "lan0", ns=router)
            sh("ip", "addr", "add", f"10.{i + 1}.0.2/24", "dev", "eth0", ns=host)
            for dev, ns in (("wan0", router), ("lan0", router), ("eth0", host)):
                sh("ip", "link", "set", dev, "up", ns=ns)
            sh("ip", "route", "add", "default", "via", f"10.{i + 1}.0.1", ns=host)
            sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=router)
            masq = "masquerade random,fully-random" if i in self.symmetric else "masquerade"
            rules = self.tmp / f"nat{i}.nft"
            guard = ('    type filter hook {} priority 0; policy accept;\n'
                     '    iifname "wan0" ct state established,related accept\n    iifname "wan0" drop\n')
            rules.write_text(
                "table ip erdmanat {\n"
                "  chain post {\n    type nat hook postrouting priority 100;\n"
                f"    oifname \"wan0\" {masq}\n  }}\n"
                f"  chain forward_guard {{\n{guard.format('forward')}  }}\n"
                f"  chain inbound {{\n{guard.format('input')}  }}\n"
                "}\n")
            sh("nft", "-f", str(rules), ns=router)
        self.turn_ca = certs.write(self.tmp, STUN[0])  # coturn serves TURN over TLS too (TURN_TLS_PORT)
        self.stun = subprocess.Popen(
            ["ip", "netns", "exec", pub, "turnserver", "-L", STUN[0], "-L", STUN_CHECK[0], "-p", str(STUN[1]),
             "--lt-cred-mech", f"--user={TURN_USER}:{TURN_PASSWORD}", "--realm=erdma.test", "--no-cli",
             "--denied-peer-ip=10.0.0.0-10.255.255.255", "--no-multicast-peers",
             f"--tls-listening-port={TURN_TLS_PORT}", f"--cert={self.tmp / 'turn-cert.pem'}",
             f"--pkey={self.tmp / 'turn-key.pem'}", "--no-dtls", "--log-file", str(self.tmp / "turnserver.log"),
             "--simple-log",
             "--pidfile", str(self.tmp / "turnserver.pid")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.Popen(["ip", "netns", "exec", pub, "stund", "-h", STUN[0], "-a", STUN_CHECK[0], "-p", str(RFC3489[1]),
                          "-o", str(RFC3489[1] + 1)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)  # both listening (stund goes with the namespace)

    def _public_host(self, pub: str, i: int) -> None:
        host = self._add(f"h{i}")
        dev, peer = f"{self.p}w{i}", f"{self.p}W{i}"
        sh("ip", "link", "add", dev, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", dev, "netns", host, "name", "eth0")
        sh("ip", "link", "set", peer, "netns", pub)
        sh("ip", "link", "set", peer, "master", "br0", "up", ns=pub)
        sh("ip", "addr", "add", f"{self.wan(i)}/24", "dev", "eth0", ns=host)
        sh("ip", "link", "set", "eth0", "up", ns=host)

    def serve_dht(self, port: int = 4222) -> str:
        """Start a DHT server node (``erdma dht serve``) on the public segment; its ``HOST:PORT``."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns("pub"), sys.executable, "-m", "erdma_core.cli", "dht",
                                 "serve", "--bind", STUN[0], "--port", str(port)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        line = first_line(proc, 15.0)
        if "serving on" not in line:
            raise RuntimeError(f"erdma dht serve did not start: {line}")
        return f"{STUN[0]}:{port}"

    def block_direct(self, a: int, b: int, proto: str = "") -> None:
        """A firewall at site ``a``'s NAT router drops every packet between the two sites' public addresses
        (the relay stays reachable), or only those of ``proto`` ("tcp", "udp"). Both must be sites behind a NAT."""
        router = self.ns(f"r{a}")
        only = ["meta", "l4proto", proto] if proto else []
        for match in ("daddr", "saddr"):
            sh("nft", "insert", "rule", "ip", "erdmanat", "forward_guard", "ip", match, self.wan(b), *only, "drop",
               ns=router)

    def partition(self, side: set[int]) -> None:
        """Cut the public hosts of ``side`` off from the other public hosts, both ways (the public segment's
        bridge drops what passes between them; the DHT node, STUN and TURN stay reachable from both)."""
        pub = self.ns("pub")
        sh("nft", "add", "table", "bridge", "erdmapart", ns=pub)
        sh("nft", "add", "chain", "bridge", "erdmapart", "cut", "{ type filter hook forward priority 0; }", ns=pub)
        others = [i for i in self.public if i not in side]
        for a in side:
            for b in others:
                for src, dst in ((a, b), (b, a)):
                    sh("nft", "add", "rule", "bridge", "erdmapart", "cut", "ip", "saddr", self.wan(src), "ip",
                       "daddr", self.wan(dst), "drop", ns=pub)

    def heal(self) -> None:
        """Lift ``partition``."""
        sh("nft", "delete", "table", "bridge", "erdmapart", ns=self.ns("pub"))

    def block_udp(self, site: int) -> None:
        """Site ``site``'s router drops every UDP packet it would forward, both ways (a site that allows TCP only)."""
        sh("nft", "insert", "rule", "ip", "erdmanat", "forward_guard", "meta", "l4proto", "udp", "drop",
           ns=self.ns(f"r{site}"))

    def block_port(self, site: int, proto: str, port: int) -> None:
        """Site ``site``'s router drops what it would forward to or from ``port`` over ``proto`` ("tcp", "udp")."""
        for match in ("dport", "sport"):
            sh("nft", "insert", "rule", "ip", "erdmanat", "forward_guard", proto, match, str(port), "drop",
               ns=self.ns(f"r{site}"))

    def unblock_direct(self, a: int, b: int, proto: str = "") -> None:
        """Lift the firewall ``block_direct(a, b, proto)`` put up at site ``a``'s router."""
        router = self.ns(f"r{a}")
        listed = sh("nft", "-a", "list", "chain", "ip", "erdmanat", "forward_guard", ns=router)
        for line in listed.splitlines():
            ours = f" {self.wan(b)} " in line and f" {proto} drop" in line if proto else f" {self.wan(b)} drop" in line
            if ours and "# handle " in line:
                sh("nft", "delete", "rule", "ip", "erdmanat", "forward_guard", "handle", line.rsplit(" ", 1)[1],
                   ns=router)

    def cap_relay(self, rate: str) -> None:
        """What coturn sends towards each site (its STUN answers and everything it relays) at most ``rate``
        (tc htb, e.g. "16mbit"): a relay further away, or shared, than the sites are from each other."""
        pub = self.ns("pub")
        for i in range(self.sites):
            dev = f"{self.p}W{i}"
            sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10", ns=pub)
            sh("tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit", ns=pub)
            sh("tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", rate, ns=pub)
            for host in (STUN[0], STUN_CHECK[0]):
                sh("tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "u32", "match", "ip", "src",
                   f"{host}/32", "flowid", "1:20", ns=pub)

    def cap_sites(self, rate: str) -> None:
        """Every site's link to the public segment carries at most ``rate`` each way (tbf, e.g. "100mbit"): on
        the bridge's port towards the site, and on the site's own end of that link."""
        for i in range(self.sites):
            shape = ("tbf", "rate", rate, "burst", "256kb", "latency", "100ms")
            sh("tc", "qdisc", "add", "dev", f"{self.p}W{i}", "root", *shape, ns=self.ns("pub"))
            own, dev = (self.host(i), "eth0") if i in self.public else (self.ns(f"r{i}"), "wan0")
            sh("tc", "qdisc", "add", "dev", dev, "root", *shape, ns=own)

    def stop_turn(self) -> None:
        """Stop coturn (STUN and TURN) now."""
        if self.stun is not None and self.stun.poll() is None:
            self.stun.terminate()
            try:
                self.stun.wait(5)
            except subprocess.TimeoutExpired:
                self.stun.kill()
                self.stun.wait()

    def close(self) -> None:
        self.stop_turn()
        for ns in reversed(self.namespaces):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
