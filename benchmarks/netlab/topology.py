"""An emulated wide-area network on one machine: one network namespace per rank, joined through a switch
namespace where ``erdma-relay`` (relay.c) delays, drops and reorders frames, with tbf qdiscs limiting rate.

    rank i (ns <lab>-r<i>, eth0 = 10.77.S.(i+1)) --veth-- p<i> (ns <lab>-sw) -- erdma-relay -- p<j> ... rank j

A frame from rank i to rank j crosses the relay once, so the one-way delay is rtt/2 and loss applies once
per direction. Each rank has an access link of ``rate`` in each direction (tbf on its eth0 for the uplink,
on p<i> for the downlink, queue of one bandwidth-delay product). Segmentation offloads are off on every veth,
so frames stay within the MTU and the relay sees real packets. With ``host_port`` the root namespace joins
the switch too (10.77.S.254), which lets programs there (mpirun's daemon) reach the ranks.

Namespaces are named ``erl<pid>-...``: a lab removes its own at exit, on SIGINT/SIGTERM, and
``remove_stale()`` removes those of dead processes.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from erdma_core.transport.leftovers import running

HERE = Path(__file__).resolve().parent
RELAY_SRC = HERE / "relay.c"
RELAY_BIN = HERE / "build" / "erdma-relay"
CONGESTION_CONTROLS = ("bbr", "cubic", "reno")


class LabError(RuntimeError):
    pass


@attrs.frozen
class LinkSpec:
    """The emulated path between any two ranks."""

    rtt_ms: float = 0.0
    jitter_ms: float = 0.0  # uniform +-jitter on each one-way delay (reorders frames, as netem's does)
    loss: float = 0.0  # fraction dropped per direction
    reorder: float = 0.0  # fraction held back by reorder_gap_ms, so that later frames overtake them
    reorder_gap_ms: float = 1.0
    rate_mbit: float | None = None  # access-link rate per rank and direction; None: as fast as the relay
    cc: str = "bbr"  # TCP congestion control inside every rank's namespace
    mtu: int = 1500

    def __attrs_post_init__(self) -> None:
        if self.cc not in CONGESTION_CONTROLS:
            raise ValueError(f"cc={self.cc!r}: valid choices are {', '.join(CONGESTION_CONTROLS)}")
        for name in ("loss", "reorder"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a fraction in [0, 1)")
        if not 576 <= self.mtu <= 9000:
            raise ValueError(f"mtu={self.mtu}: must be in 576..9000")


def sh(*cmd: str, ns: str | None = None, check: bool = True) -> str:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    r = subprocess.run(full, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise LabError(f"`{' '.join(full)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def build_relay() -> Path:
    """Compile relay.c if the binary is missing or older than the source."""
    if RELAY_BIN.exists() and RELAY_BIN.stat().st_mtime >= RELAY_SRC.stat().st_mtime:
        return RELAY_BIN
    RELAY_BIN.parent.mkdir(exist_ok=True)
    tmp = RELAY_BIN.with_suffix(f".{os.getpid()}")
    sh("cc", "-O2", "-Wall", "-o", str(tmp), str(RELAY_SRC))
    tmp.replace(RELAY_BIN)
    return RELAY_BIN


def remove_stale() -> list[str]:
    """Delete lab namespaces whose creating process is gone."""
    removed = []
    for line in sh("ip", "netns", "list").splitlines():
        m = re.match(r"(erl(\d+)-\S+)", line)
        if m and not running(int(m.group(2))):
            sh("ip", "netns", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


class Lab:
    """``with Lab(4, LinkSpec(rtt_ms=40, loss=0.01, rate_mbit=100)) as lab: lab.popen(0, [...])``"""

    _count = 0

    def __init__(self, n: int, spec: LinkSpec, *, host_port: bool = False) -> None:
        if not 2 <= n <= 30:
            raise ValueError(f"ranks={n}: the lab holds 2..30 ranks")
        Lab._count += 1
        self.n, self.spec, self.host_port = n, spec, host_port
        self.name = f"erl{os.getpid()}-{Lab._count}"
        self.subnet = 10 + (os.getpid() * 7 + Lab._count) % 240  # 10.77.<subnet>.0/24
        self.switch = f"{self.name}-sw"
        self.ranks = [f"{self.name}-r{i}" for i in range(n)]
        self.host_if = f"erlh{os.getpid() % 100000}{Lab._count}"[:15]
        self.relay: subprocess.Popen[str] | None = None
        self.relay_stats: dict[str, Any] = {}
        self._made: list[str] = []
        self._old_handlers: dict[int, Any] = {}

    def addr(self, i: int) -> str:
        return f"10.77.{self.subnet}.{i + 1}"

    @property
    def host_addr(self) -> str:
        return f"10.77.{self.subnet}.254"

    # ---- life cycle -------------------------------------------------------------------------------------
    def __enter__(self) -> Lab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        relay = build_relay()
        atexit.register(self.down)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build(relay)
        except BaseException:
            self.down()
            raise

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.down()
        handler = self._old_handlers.get(signum)
        if callable(handler):
            handler(signum, frame)
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def _netns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self._made.append(name)

    def _offloads_off(self, dev: str, ns: str | None) -> None:
        sh("ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off", "tx", "off", "rx", "off", ns=ns)

    def _tbf(self, dev: str, ns: str | None) -> None:
        rate = self.spec.rate_mbit
        if rate is None:
            return
        bps = rate * 1e6 / 8
        frame = self.spec.mtu + 14
        burst = int(max(bps * 0.001, 4 * frame))  # 1 ms of line rate
        limit = int(max(bps * max(self.spec.rtt_ms, 10.0) / 1e3, 64 * frame))  # one BDP of queue
        sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}mbit", "burst", str(burst),
           "limit", str(limit), ns=ns)

    def _allow_cc(self) -> None:
        """A namespace may only pick a congestion control the root namespace allows: add ours to the list."""
        path = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
        allowed = path.read_text().split()
        if self.spec.cc not in allowed:
            sh("sysctl", "-qw", f"net.ipv4.tcp_allowed_congestion_control={' '.join([*allowed, self.spec.cc])}")

    def _build(self, relay: Path) -> None:
        s = self.spec
        self._allow_cc()
        self._netns(self.switch)
        sh("ip", "link", "set", "lo", "up", ns=self.switch)
        ports = []
        for i, ns in enumerate(self.ranks):
            self._netns(ns)
            port = f"p{i}"
            sh("ip", "link", "add", "eth0", "netns", ns, "mtu", str(s.mtu), "type", "veth", "peer", "name", port,
               "netns", self.switch, "mtu", str(s.mtu))
            sh("ip", "addr", "add", f"{self.addr(i)}/24", "dev", "eth0", ns=ns)
            for dev in ("lo", "eth0"):
                sh("ip", "link", "set", dev, "up", ns=ns)
            sh("ip", "link", "set", port, "up", ns=self.switch)
            self._offloads_off("eth0", ns)
            self._offloads_off(port, self.switch)
            sh("sysctl", "-qw", f"net.ipv4.tcp_congestion_control={s.cc}", ns=ns)
            self._tbf("eth0", ns)
            self._tbf(port, self.switch)
            ports.append(port)
        if self.host_port:
            sh("ip", "link", "add", self.host_if, "mtu", str(s.mtu), "type", "veth", "peer", "name", "ph",
               "netns", self.switch, "mtu", str(s.mtu))
            sh("ip", "addr", "add", f"{self.host_addr}/24", "dev", self.host_if)
            sh("ip", "link", "set", self.host_if, "up")
            sh("ip", "link", "set", "ph", "up", ns=self.switch)
            self._offloads_off(self.host_if, None)
            self._offloads_off("ph", self.switch)
            ports.append("ph")
        cmd = ["ip", "netns", "exec", self.switch, str(relay), "--delay-us", str(int(s.rtt_ms * 500)),
               "--jitter-us", str(int(s.jitter_ms * 1000)), "--loss-ppm", str(round(s.loss * 1e6)),
               "--reorder-ppm", str(round(s.reorder * 1e6)), "--reorder-gap-us", str(int(s.reorder_gap_ms * 1000)),
               "--seed", str(os.getpid()), *ports]
        self.relay = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.relay.stdout is not None
        line = self.relay.stdout.readline()
        if not line.startswith('{"ready": true'):
            raise LabError(f"erdma-relay did not start: {line}{self.relay.stderr.read() if self.relay.stderr else ''}")
        self._wait_reachable()

    def queue_drops(self) -> int:
        """Packets the rate limiters (tbf, rank uplinks and switch downlinks) have dropped so far."""
        total = 0
        for ns in (self.switch, *self.ranks):
            out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc"], capture_output=True, text=True,
                                 check=True).stdout
            total += sum(int(m) for m in re.findall(r"dropped (\d+)", out))
        return total

    def _wait_reachable(self, timeout: float = 30.0) -> None:
        """Every rank answers ARP through the relay before the lab is handed out (on a lossy link a ping and
        its answer both arrive about (1 - loss)^2 of the time: it takes tries)."""
        deadline = time.monotonic() + timeout
        for i in range(1, self.n):
            while True:
                r = subprocess.run(["ip", "netns", "exec", self.ranks[0], "ping", "-c1", "-W0.5", self.addr(i)],
                                   capture_output=True)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise LabError(f"rank {i} ({self.addr(i)}) unreachable from rank 0 through the relay")

    def down(self) -> None:
        if self.relay is not None and self.relay.poll() is None:
            self.relay.send_signal(signal.SIGTERM)
            try:
                out, _ = self.relay.communicate(timeout=5)
                last = [ln for ln in out.splitlines() if ln.startswith("{")]
                if last:
                    self.relay_stats = json.loads(last[-1])
            except subprocess.TimeoutExpired:
                self.relay.kill()
                self.relay.wait()
        self.relay = None
        for name in reversed(self._made):
            sh("ip", "netns", "del", name, check=False)  # deleting a namespace deletes its veth ends
        self._made.clear()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        atexit.unregister(self.down)

    # ---- running things inside ------------------------------------------------------------------------
    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ranks[i], *argv]

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.command(i, argv), **kw)

    def relay_counters(self) -> dict[str, Any]:
        """The relay's counters so far (it prints them on SIGUSR1)."""
        if self.relay is None or self.relay.stdout is None:
            return dict(self.relay_stats)
        self.relay.send_signal(signal.SIGUSR1)
        return json.loads(self.relay.stdout.readline())
