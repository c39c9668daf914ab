"""af_packet on veth pairs in a network namespace of their own (root only): each rank's interface joins a
bridge whose forwarding drops 1% of the transport's frames at random (nftables, ``numgen random``: the
kernel here has no netem), and the core's collective tests still pass byte for byte on 2 and 4 ranks, thanks
to retransmission, and so do its failure tests (a killed peer is noticed by silence: ``peer_timeout``); the
counters and the bridge's drop counter show the loss was there. A bridge that changes a byte of every full
packet fails the job with an ``IntegrityError`` on both ranks instead of a wrong sum."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import needs_dpdk

HERE = Path(__file__).resolve().parents[1]
CORE_TESTS = HERE.parents[1] / "tests"
RANKS = 4
LOSS = """table bridge erdmaloss {
  chain lossy { type filter hook forward priority 0; ether type 0x88b5 numgen random mod 100 < 1 counter drop; }
}
"""

pytestmark = [
    needs_dpdk,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nft"),
                       reason="needs root, ip and nft (network namespaces)"),
]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def lab() -> Iterator[str]:
    ns = f"erdma-dpdk-{os.getpid()}"
    _ip("netns", "add", ns)
    try:
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", ns, "link", "set", "br0", "up")
        for r in range(RANKS):
            # DPDK 22.11's af_packet joins fanout group (pid ^ ifindex) & 0xffff: two ranks of close pids on
            # interfaces of close indexes clashed ("could not set PACKET_FANOUT ... Invalid argument")
            _ip("-n", ns, "link", "add", f"v{r}", "index", str(0x1000 * (r + 1) + 7), "type", "veth", "peer",
                "name", f"b{r}")
            _ip("-n", ns, "link", "set", f"b{r}", "master", "br0")
            for dev in (f"v{r}", f"b{r}"):  # no IPv6 chatter on the wire
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{dev}.disable_ipv6=1"],
                               check=True, timeout=30)
                _ip("-n", ns, "link", "set", dev, "up")
        subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=LOSS, text=True, check=True, timeout=30)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _in(ns: str, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", ns, *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=timeout, cwd=HERE)


def _dropped(ns: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "nft", "-j", "list", "table", "bridge", "erdmaloss"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return sum(item["rule"]["expr"][-2]["counter"]["packets"] for item in json.loads(out)["nftables"]
               if "rule" in item)


AF_PACKET = {"ERDMA_TRANSPORT": "dpdk", "ERDMA_TRANSPORT_DPDK_BACKEND": "af_packet",
             "ERDMA_TRANSPORT_DPDK_INTERFACE": "v{rank}"}


# each on a worker of its own under `make test` (--dist loadgroup; a bridge each): together on one they were
# 151 s of the plugin's 164
@pytest.mark.parametrize("tests", [pytest.param(f, marks=pytest.mark.xdist_group(f"lossy bridge: {f}"))
                                   for f in ("test_collectives.py", "test_failures.py")])
def test_the_cores_tests_pass_through_a_lossy_bridge(lab, tests):
    before = _dropped(lab)
    run = _in(lab, [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                    str(CORE_TESTS / tests)], {**AF_PACKET, "PYTEST_ERDMA_WORLDS": "2,4"}, 900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
    assert _dropped(lab) - before > 50  # the loss was there: many frames dropped and sent again


EXCHANGE = """
import json
from erdma_core.testing.world import World
from tests.test_recovery import _exchange
with World(2, {"transport.name": "dpdk", "timeouts.collective": 60.0}, timeout=120) as world:
    print(json.dumps(world.run(_exchange, [1, 1500, 300_000, 8 << 20])))
"""


def test_what_the_bridge_drops_is_sent_again(lab):
    run = _in(lab, [sys.executable, "-c", EXCHANGE], AF_PACKET, 300)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(ok for ok, _, _ in results), results
    assert all(retransmits > 0 for _, retransmits, _ in results), results


REFUSED = """
import erdma_core
from erdma_core.sdk import ConfigError
try:
    erdma_core.init({"transport.name": "dpdk", "transport.dpdk.frame_bytes": 9000}, rank=0, world_size=1,
                    init_method="file://%s/store")
except ConfigError as exc:
    print(exc)
"""


def test_a_frame_larger_than_the_mtu_is_refused(lab, tmp_path):
    run = _in(lab, [sys.executable, "-c", REFUSED % tmp_path], AF_PACKET, 120)
    assert "'transport.dpdk.frame_bytes': frame 9000 > 1514, the most interface v0's MTU 1500 carries" in run.stdout, \
        run.stdout + run.stderr[-3000:]


FLIP = """table bridge erdmaflip {
  chain flip { type filter hook forward priority 1; ether type 0x88b5 meta length > 1400 @ll,8000,8 set 0x5a counter; }
}
"""
FLIPPED = """
import json
import numpy as np
from erdma_core.testing.world import World

def allreduce(pg):
    x = np.random.default_rng(pg.rank()).standard_normal(1 << 18).astype(np.float32)
    pg.allreduce(x)
    return x.tolist() == sum(np.random.default_rng(r).standard_normal(1 << 18).astype(np.float32) for r in range(2)).tolist()

with World(2, {"transport.name": "dpdk", "timeouts.collective": 60.0}, timeout=120) as world:
    print(json.dumps([repr(o) if isinstance(o, bool) else [type(o).__name__, str(o), o.rank, o.peer]
                      for o in world.outcomes(allreduce)]))
"""


def test_a_byte_changed_on_the_way_fails_both_ranks(lab):
    """The bridge sets byte 1000 of every full packet (inside the 1 MiB payloads) to 0x5a: without the seal
    the sums came out wrong on both ranks; with it a receiver's check fails and it aborts the job."""
    subprocess.run(["ip", "netns", "exec", lab, "nft", "-f", "-"], input=FLIP, text=True, check=True, timeout=30)
    try:
        run = _in(lab, [sys.executable, "-c", FLIPPED], AF_PACKET, 300)
    finally:
        subprocess.run(["ip", "netns", "exec", lab, "nft", "delete", "table", "bridge", "erdmaflip"], timeout=30)
    assert run.returncode == 0, run.stderr[-4000:]
    outcomes = json.loads(run.stdout.strip().splitlines()[-1])
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, list) and outcome[0] == "IntegrityError" and outcome[2] == rank, outcomes
        assert "integrity check failed on a frame from rank " in outcome[1], outcome
        assert "over DPDK af_packet on v" in outcome[1] and "the payload's tag does not match" in outcome[1], outcome
