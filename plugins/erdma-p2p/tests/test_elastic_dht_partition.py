"""A partition of an elastic job on ``dht://`` alone, between processes on hosts of their own (network
namespaces, ``NatLab`` with every host on the public segment): one member is cut off from the other two, both
ways, while all of them still reach the DHT node. The two (a majority of the epoch) form the next epoch and
step on; the one pauses, says so, and steps no more. Once the cut is lifted it finds itself counted out and
joins again as a newcomer. One state hash per step across all three: no split brain."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from erdma_p2p.lab.natlab import STUN, NatLab, available, first_line

from erdma_core.testing.elastic import ElasticJob, Peer, python, steps, until

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))
SECRET = "elastic-partition"
STEP = re.compile(r"step (\d+) n (\d+) .* hash (\w+) ")
ENV = {"STEPS": "100000", "ELEMENTS": "1024", "ERDMA_DISCOVERY_DHT_SERVE": "1",
       "ERDMA_DISCOVERY_DHT_RPC_TIMEOUT": "1.0", "ERDMA_DISCOVERY_DHT_POLL_MAX": "0.1",
       "ERDMA_ELASTIC_LIVENESS_TIMEOUT": "3.0"}
CUT_S = 25.0


def found_in(lab: NatLab, dht: str, job: str) -> subprocess.Popen[str]:
    """The job's creator, on the public segment: writes its first epoch once 3 peers drew tickets."""
    host, port = dht.rsplit(":", 1)
    code = ("from erdma_p2p.dht_store import DhtStore; from erdma_core.elastic.founding import found; "
            f"s = DhtStore([({host!r}, {port})], {job!r}, {SECRET!r}.encode(), timeout=10.0, "
            "section={'port': 0, 'bind_address': %r, 'rpc_timeout': 1.0, 'ttl': 600.0, 'poll_max': 0.1}); " % STUN[0]
            + "print('up', flush=True); found(s, 'default', 3, 120.0); print('founded', flush=True); "
            "import time; time.sleep(3600)")
    proc = subprocess.Popen(["ip", "netns", "exec", lab.ns("pub"), sys.executable, "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert first_line(proc, 30).strip() == "up", "the creator did not start"
    return proc


@contextlib.contextmanager
def dht_job(lab: NatLab, tmp_path: Path, name: str, env: dict[str, str]) -> Iterator[ElasticJob]:
    """A job of 3 peers (``min_peers``) on a DHT node of ``lab``'s public segment, founded by a creator there;
    the peers stop at ``tmp_path / "stop"``."""
    dht = lab.serve_dht()
    creator = found_in(lab, dht, name)
    try:
        with ElasticJob(python("-m", "erdma_core.testing.elastic_peer"), tmp_path, min_peers=3, secret=SECRET,
                        store_url=f"dht://{dht}/{name}", env={**env, "STOP_FILE": str(tmp_path / "stop")}) as job:
            yield job
    finally:
        creator.kill()


def one_hash_per_step(*peers: Peer) -> None:
    hashes: dict[int, set[str]] = {}
    for p in peers:
        for m in filter(None, map(STEP.search, p.lines)):
            hashes.setdefault(int(m.group(1)), set()).add(m.group(3))
    assert hashes and all(len(h) == 1 for h in hashes.values()), {s: h for s, h in hashes.items() if len(h) > 1}


def test_the_side_without_a_majority_pauses_the_other_steps_on_and_the_cut_off_member_rejoins(tmp_path: Path) -> None:
    with NatLab(3, tmp_path, public=frozenset({0, 1, 2})) as lab, dht_job(lab, tmp_path, "part", ENV) as job:
        cut, a, b = (job.start(wrap=["ip", "netns", "exec", lab.host(i)]) for i in range(3))
        until(lambda: all(len(steps(p)) >= 3 for p in (cut, a, b)), "3 steps of the three", 180)
        lab.partition({0})
        cut_at, before_cut = time.monotonic(), len(steps(cut))
        until(lambda: any(" n 2 " in line for line in steps(a)), "a step of the two without the one", 60)
        time.sleep(max(0.0, cut_at + CUT_S - time.monotonic()))
        # the one cut off: at most the step it was in when the cut came, then nothing; it says it paused
        assert len(steps(cut)) <= before_cut + 1, steps(cut)[before_cut:]
        assert any("paused" in line and "cut off from a majority" in line for line in cut.lines), \
            "\n".join(cut.lines[-10:])
        lab.heal()
        until(lambda: any(" n 3 " in line for line in steps(cut)[before_cut + 1:]),
              "the one cut off stepping with the two again", 120)
        (tmp_path / "stop").touch()
        assert [p.wait(60) for p in (cut, a, b)] == [0, 0, 0], "\n".join(cut.lines[-10:])
        one_hash_per_step(cut, a, b)
