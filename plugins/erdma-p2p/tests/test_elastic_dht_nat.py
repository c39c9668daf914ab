"""A newcomer behind a NAT joins an elastic job on ``dht://`` alone (network namespaces, ``NatLab``): three
members on the public segment serve the DHT and the job; the newcomer, behind a masquerade NAT, reaches them
through it. Nobody can dial it: it dials the members' mesh, which answers on the connections it made (a
member dropped them at each step while the newcomer checked its paths, as links to peers no record names,
and could not dial back: the check never started), and its pairs with the members meet through the NAT (STUN
traversal). It is admitted, receives the state and steps with them; one state hash per step across all
four."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from erdma_p2p.lab.natlab import STUN, NatLab, available
from test_elastic_dht_partition import ENV, dht_job, one_hash_per_step

from erdma_core.testing.elastic import steps, until

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))
NAT_ENV = {**ENV, "ERDMA_TRANSPORT": "tcp", "ERDMA_TRAVERSAL": "stun",
           "ERDMA_TRAVERSAL_STUN_SERVER": f"{STUN[0]}:{STUN[1]}"}


def test_a_newcomer_behind_a_nat_is_admitted_and_steps_with_the_members(tmp_path: Path) -> None:
    with NatLab(4, tmp_path, public=frozenset({0, 1, 2})) as lab, dht_job(lab, tmp_path, "nat", NAT_ENV) as job:
        members = [job.start(wrap=["ip", "netns", "exec", lab.host(i)]) for i in range(3)]
        until(lambda: all(len(steps(p)) >= 3 for p in members), "3 steps of the three", 180)
        started = time.monotonic()
        newcomer = job.start(wrap=["ip", "netns", "exec", lab.host(3)])
        until(lambda: any(" n 4 " in line for line in steps(newcomer)), "a step of the four", 120)
        admitted_s = time.monotonic() - started
        until(lambda: sum(" n 4 " in line for line in steps(members[0])) >= 3, "3 steps of the four", 60)
        (tmp_path / "stop").touch()
        peers = [*members, newcomer]
        assert [p.wait(60) for p in peers] == [0, 0, 0, 0], "\n\n".join(
            f"{p.log}:\n" + "\n".join(p.lines[-10:]) for p in peers)
        one_hash_per_step(*peers)
        print(f"newcomer behind a NAT: first step with the members {admitted_s:.1f} s after it started")
