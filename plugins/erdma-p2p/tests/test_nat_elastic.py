"""An elastic job behind NATs on the built-in TCP (every pair meets through its NATs), with its store on the
public side: a newcomer behind a NAT that maps each destination anew cannot meet any member. The members lose
one connect timeout to it and go on stepping; the newcomer leaves with an error naming the pairs, instead of
being taken into every next epoch and failing each one."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from erdma_p2p.lab.natlab import STUN, NatLab, available

from erdma_core.testing.elastic import ElasticJob, python, steps, until

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))
STORE = ("198.51.100.1", 29500)
CONNECT_S = 8


def serve_store(lab: NatLab) -> subprocess.Popen[str]:
    """A TCP store on the public segment (in its namespace), as `erdma run --elastic` serves one."""
    code = ("import time; from erdma_core.discovery import TCPStore; "
            f"s = TCPStore({STORE[0]!r}, {STORE[1]}, is_server=True, timeout=10.0, secret=b'elastic-nat'); "
            "print('up', flush=True); time.sleep(3600)")
    proc = subprocess.Popen(["ip", "netns", "exec", lab.ns("pub"), sys.executable, "-c", code],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def test_an_unreachable_newcomer_leaves_naming_the_pairs_and_the_members_go_on(tmp_path):
    env = {"ERDMA_TRANSPORT": "tcp", "ERDMA_TRAVERSAL": "stun", "ERDMA_TRAVERSAL_STUN_SERVER": f"{STUN[0]}:{STUN[1]}",
           "ERDMA_TIMEOUTS_CONNECT": str(CONNECT_S), "STEPS": "100000", "ELEMENTS": "1024",
           "STOP_FILE": str(tmp_path / "stop")}
    with NatLab(4, tmp_path, symmetric=frozenset({3})) as lab:
        store = serve_store(lab)
        try:
            with ElasticJob(python("-m", "erdma_core.testing.elastic_peer"), tmp_path, min_peers=3,
                            secret="elastic-nat", env=env, store_url=f"tcp://{STORE[0]}:{STORE[1]}") as job:
                members = [job.start(wrap=["ip", "netns", "exec", lab.host(i)]) for i in range(3)]
                until(lambda: len(steps(members[0])) >= 3, "3 steps of the three members")
                newcomer = job.start(wrap=["ip", "netns", "exec", lab.host(3)])
                started, before = time.monotonic(), len(steps(members[0]))
                code = newcomer.wait(CONNECT_S + 60)
                until(lambda: len(steps(members[0])) >= before + 10, "10 steps after the newcomer started", 90)
                within = time.monotonic() - started
                (tmp_path / "stop").touch()
                assert [p.wait(60) for p in members] == [0, 0, 0], members[0].lines[-10:]
        finally:
            store.kill()
    said = "\n".join(newcomer.lines)
    assert code == 1, said
    assert "UnreachableError: elastic: " in said and "cannot take part in job 'default' from where it runs" in said
    assert said.count(" - ") >= 3 and "no connection within timeouts.connect for the pairs" in said, said
    assert within < 90, within
    epochs = {line.split()[9] for line in steps(members[0])}
    hashes: dict[str, set[str]] = {}
    for p in members:
        for line in steps(p):
            hashes.setdefault(line.split()[1], set()).add(line.split()[11])
    assert all(len(h) == 1 for h in hashes.values()), hashes
    assert all(" n 3 " in line for line in steps(members[0])), steps(members[0])[-5:]
    assert len(epochs) <= 3, epochs  # the first, the one that took the newcomer in, the one after
