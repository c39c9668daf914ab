"""Elastic jobs behind NATs, with their store on the public side. On the built-in TCP (every pair meets through
its NATs): a newcomer behind a NAT that maps each destination anew cannot meet any member. Its paths are
checked before it is admitted, beside the members' steps: the members lose nothing to it and stay in their
epoch; the newcomer says which pairs failed, checks again later, and leaves at its join timeout with an
error naming the pairs. With the check off, the members lose one connect timeout to it. On QUIC: a pair whose
direct path moves to the relay and back reorders every member's ring at a step boundary, with no step aborted."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from erdma_p2p.lab.jobs import RELAY
from erdma_p2p.lab.natlab import STUN, NatLab, available, first_line

from erdma_core.testing.elastic import ElasticJob, python, steps, until

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))
STORE = ("198.51.100.1", 29500)
CONNECT_S = 8
PAIRED_ENV = {**RELAY, "ERDMA_TRANSPORT": "tcp", "ERDMA_TRANSPORT_FALLBACK": "quic",
              "ERDMA_TRAVERSAL_STUN_SERVER": f"{STUN[0]}:{STUN[1]}"}


def serve_store(lab: NatLab) -> subprocess.Popen[str]:
    """A TCP store on the public segment (in its namespace), as `erdma run --elastic` serves one."""
    code = ("import time; from erdma_core.discovery import TCPStore; "
            f"s = TCPStore({STORE[0]!r}, {STORE[1]}, is_server=True, timeout=10.0, secret=b'elastic-nat'); "
            "print('up', flush=True); time.sleep(3600)")
    proc = subprocess.Popen(["ip", "netns", "exec", lab.ns("pub"), sys.executable, "-c", code],
                            stdout=subprocess.PIPE, text=True)
    assert first_line(proc, 30).strip() == "up", "the store did not start within 30 s"
    return proc


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_an_unreachable_newcomer_leaves_naming_the_pairs_and_the_members_go_on(tmp_path, checked):
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
                newcomer = job.start({"ERDMA_ELASTIC_JOIN_TIMEOUT": "30",
                                      "ERDMA_ELASTIC_ADMISSION_CHECK": str(checked).lower()},
                                     wrap=["ip", "netns", "exec", lab.host(3)])
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
    if checked:  # never put into an epoch; it checked twice (5 s apart), and said so the first time
        assert epochs == {"1"}, epochs
        assert said.count("Checking again in 5s.") == 1 and "(checked before it was admitted" in said, said
        assert "It stopped checking at elastic.join_timeout (30s)." in said, said
        assert all(" retried 0 " in line for line in steps(members[0])), steps(members[0])[-5:]
    else:
        assert len(epochs) <= 3, epochs  # the first, the one that took the newcomer in, the one after


PEER_INFO = ("-c", "import logging, runpy; logging.basicConfig(level=logging.INFO); "
             "runpy.run_module('erdma_core.testing.elastic_peer', run_name='__main__')")


def test_an_epoch_after_a_kill_does_not_check_again_the_pairs_an_earlier_one_lost(tmp_path):
    """An elastic job on TCP with QUIC as the fallback and a relay: members at two ordinary NATs and one that
    maps each destination anew. The first epoch checks every pair: the symmetric site's pairs lose the TCP
    check and QUIC's direct check, and run relayed. A member is killed; the next epoch's set-up meets the
    remaining pair with neither check (each end remembers the verdict: ``verdicts``), dials the relay first from
    the data socket an earlier epoch prepared, with its mapping and relay allocation (``kept``: no STUN query, no
    new allocation; each survivor's old group closes first, also the one that was waiting on the killed member's
    acknowledgements), and the members go on with one hash per step."""
    env = {**PAIRED_ENV, "ERDMA_TIMEOUTS_CONNECT": "20", "STEPS": "100000", "ELEMENTS": "1024",
           "STOP_FILE": str(tmp_path / "stop")}
    with NatLab(3, tmp_path, symmetric=frozenset({2})) as lab:
        store = serve_store(lab)
        try:
            with ElasticJob(python(*PEER_INFO), tmp_path, min_peers=3, secret="elastic-nat", env=env,
                            store_url=f"tcp://{STORE[0]}:{STORE[1]}") as job:
                members = [job.start(wrap=["ip", "netns", "exec", lab.host(i)]) for i in range(3)]
                until(lambda: len(steps(members[0])) >= 3, "3 steps of the three members", 120)
                members[1].kill()
                before = len(steps(members[0]))
                until(lambda: sum(" n 2 " in line for line in steps(members[0])[before:]) >= 3, "3 steps of two")
                (tmp_path / "stop").touch()
                assert [members[i].wait(60) for i in (0, 2)] == [0, 0], members[0].lines[-10:]
        finally:
            store.kill()
    later = [line for p in (members[0], members[2]) for line in p.lines]
    assert any("not met over TCP in a set-up" in line for line in later), "\n".join(later[-40:])
    assert any("was reached through the relay in a set-up" in line and "dialled there first" in line
               for line in later), "\n".join(later[-40:])
    for p in (members[0], members[2]):  # each: its old group closed first (``CLOSE_WAIT_S``), its socket lent again
        kept = [line for line in p.lines if "kept from an earlier set-up of this process" in line]
        assert kept and all(", relay allocation " in line for line in kept), "\n".join(p.lines[-40:])
    hashes: dict[str, set[str]] = {}
    for p in (members[0], members[2]):
        for line in steps(p):
            hashes.setdefault(line.split()[1], set()).add(line.split()[11])
    assert all(len(h) == 1 for h in hashes.values()), hashes


def test_a_path_that_moves_to_the_relay_and_back_reorders_the_members_ring_without_an_abort(tmp_path):
    """Four members on QUIC at four ordinary NATs, every pair direct: the ring is 0-1-2-3. UDP between the sites
    of ranks 1 and 2 is dropped: that pair falls back to the relay (2 s idle timeout), its ends say their paths
    moved in the next step's votes, and from the step after every member runs its ring with 1 and 2 apart. The
    drop is lifted: the pair moves back (path_recheck 1 s) and the ring is 0-1-2-3 again. One epoch throughout
    (no step aborted), and one state hash per step on every member."""
    env = {**RELAY, "ERDMA_TRANSPORT": "quic", "ERDMA_TRAVERSAL_STUN_SERVER": f"{STUN[0]}:{STUN[1]}",
           "ERDMA_TRANSPORT_QUIC_IDLE_TIMEOUT": "2", "ERDMA_TRANSPORT_QUIC_KEEPALIVE_INTERVAL": "0.5",
           "ERDMA_TRANSPORT_QUIC_RECONNECT_TIMEOUT": "20", "ERDMA_TRANSPORT_QUIC_PATH_RECHECK": "1",
           "ERDMA_TIMEOUTS_CONNECT": "30", "ERDMA_TIMEOUTS_COLLECTIVE": "60", "ERDMA_COLLECTIVES_ALLREDUCE": "ring",
           "STEPS": "100000", "ELEMENTS": "1024", "STOP_FILE": str(tmp_path / "stop"), "SHOW_RING": "1"}

    def rings(peer) -> list[str]:
        return [line.split()[-3] for line in steps(peer)]

    with NatLab(4, tmp_path) as lab:
        store = serve_store(lab)
        try:
            with ElasticJob(python("-m", "erdma_core.testing.elastic_peer"), tmp_path, min_peers=4,
                            secret="elastic-nat", env=env, store_url=f"tcp://{STORE[0]}:{STORE[1]}") as job:
                members = [job.start(wrap=["ip", "netns", "exec", lab.host(i)]) for i in range(4)]
                until(lambda: all(len(steps(p)) >= 3 for p in members), "3 steps of every member", 120)
                site = {int(steps(p)[0].split()[-1]): i for i, p in enumerate(members)}  # rank -> its site
                assert rings(members[0])[-1] == "0,1,2,3", steps(members[0])[-3:]
                lab.block_direct(site[1], site[2], "udp")
                until(lambda: rings(members[0])[-1] == "0,1,3,2", "the ring with 1 and 2 apart", 90)
                apart = len(steps(members[0]))
                lab.unblock_direct(site[1], site[2], "udp")
                until(lambda: len(steps(members[0])) > apart and rings(members[0])[-1] == "0,1,2,3",
                      "the first ring again", 90)
                (tmp_path / "stop").touch()
                assert [p.wait(60) for p in members] == [0] * 4, members[0].lines[-10:]
        finally:
            store.kill()
    lines = [steps(p) for p in members]
    assert {line.split()[9] for p in lines for line in p} == {"1"}, lines[0][-5:]  # one epoch: nothing aborted
    by_step: dict[str, set[tuple[str, str]]] = {}
    for p in lines:
        for line in p:
            words = line.split()
            by_step.setdefault(words[1], set()).add((words[11], words[-3]))  # (state hash, ring) per step
    assert all(len(seen) == 1 for seen in by_step.values()), [s for s in by_step.values() if len(s) > 1]
