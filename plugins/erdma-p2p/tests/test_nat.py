"""Ranks behind real NATs (network namespaces, nftables masquerade, unsolicited inbound dropped; coturn as
the STUN server; see erdma_p2p/lab/natlab.py), over erdma-quic: with the ``stun`` traversal two ranks behind two NATs
connect directly and allreduce; without it, or without the punch, or with a NAT that maps each destination
to another port and no relay, they fail with a clear error within the connect timeout. With a TURN relay
(coturn), every rank offers its relayed address as its last candidate: a pair that no direct path joins
goes through it and the job completes; the others stay direct, and a direct path that breaks mid-job falls
back to the relay."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from erdma_p2p.lab import certs
from erdma_p2p.lab.jobs import CONNECT_S, TURN_HOSTS, UNREACHABLE_S, run_job, wait_started
from erdma_p2p.lab.jobs import RELAY as LAB_RELAY
from erdma_p2p.lab.natlab import RFC3489, STUN, NatLab, available

# a direct path's first check waits this long before the relay is taken (traversal.stun.check_timeout, 2 s by
# default): on this 2-core host beside another suite, a direct QUIC handshake between the lab's sites took over
# 2 s once and its pair went through the relay. Where a test blocks the direct path it waits this out in full.
CHECK_S = 8.0
RELAY = LAB_RELAY | {"ERDMA_TRAVERSAL_STUN_CHECK_TIMEOUT": str(CHECK_S)}

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


def paths(results: list[dict]) -> dict[tuple[int, int], str]:
    """(rank, peer) -> how that rank reaches that peer, "direct" or "relayed", as each rank reported it."""
    return {(rank, int(peer)): how for rank, r in enumerate(results) for peer, how in r["paths"].items()}


def expect(world: int, relayed: set[frozenset[int]]) -> dict[tuple[int, int], str]:
    """Every ordered pair of ``world`` ranks: "relayed" for the pairs in ``relayed``, else "direct"."""
    return {(a, b): "relayed" if frozenset({a, b}) in relayed else "direct"
            for a in range(world) for b in range(world) if a != b}


def test_the_data_socket_learns_its_nat_mapping(tmp_path):
    code = ("import socket; from erdma_p2p import stun; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            f"s.bind(('0.0.0.0', 0)); m = stun.query(s, {STUN!r}, 5.0); print(m.host, m.port, s.getsockname()[1])")
    with NatLab(1, tmp_path) as lab:
        out = subprocess.run(["ip", "netns", "exec", lab.host(0), sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=30)
        host, port, local = out.stdout.split()
    assert host == lab.wan(0) and int(port) > 0, out.stderr  # the router's address, not the private 10.1.0.2
    assert int(port) == int(local)  # masquerade kept the port (endpoint-independent mapping)


def test_two_ranks_behind_two_nats_connect_directly(tmp_path):
    with NatLab(2, tmp_path) as lab:
        results = run_job(lab, tmp_path, ERDMA_TRAVERSAL="stun")
    for rank, r in enumerate(results):
        assert r.get("wrong") == 0 and r["iters"] == 20, r
        assert f"{lab.wan(rank)}:" in r["advertised"]  # the NAT's public mapping, a candidate
    assert paths(results) == expect(2, set())


def test_ranks_behind_nats_find_each_other_through_the_dht(tmp_path):
    doctor: list[subprocess.CompletedProcess[str]] = []
    with NatLab(3, tmp_path, symmetric=frozenset({2})) as lab:
        node = lab.serve_dht()  # killed with the namespace

        def ask_the_doctor() -> None:  # while the job runs: what each rank published about its paths
            wait_started(tmp_path, 3)
            env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
            doctor.append(subprocess.run(["ip", "netns", "exec", lab.ns("pub"), sys.executable, "-m",
                                          "erdma_core.cli", "doctor"], capture_output=True, text=True, timeout=60,
                                         env=env | {"ERDMA_INIT_METHOD": f"dht://{node}/nat-job",
                                                    "ERDMA_SECRET": "nat-test"}))

        results = run_job(lab, tmp_path, iters=200, count=1000, during=ask_the_doctor,
                          ERDMA_INIT_METHOD=f"dht://{node}/nat-job", JOB_PAUSE="0.05", **RELAY)
    assert [r.get("wrong") for r in results] == [0] * 3, results
    assert paths(results) == expect(3, {frozenset({0, 2}), frozenset({1, 2})})
    said = doctor[0].stdout
    assert "job 'nat-job', paths as its ranks published them:" in said, doctor[0]
    rows = {int(m[1]): dict(re.findall(r"rank (\d) (direct|relayed)", m[2]))
            for m in re.finditer(r"^  rank (\d): (.*)$", said, re.M)}
    assert rows == {0: {"1": "direct", "2": "relayed"}, 1: {"0": "direct", "2": "relayed"},
                    2: {"0": "relayed", "1": "relayed"}}, said


def test_four_ranks_two_public_two_behind_nats(tmp_path):
    """With the job below, every pair of {no NAT, masquerade, fully-random} is in a 4-rank allreduce."""
    with NatLab(4, tmp_path, public=frozenset({0, 1})) as lab:
        results = run_job(lab, tmp_path, ERDMA_TRAVERSAL="stun")
    assert [r.get("wrong") for r in results] == [0] * 4, results
    assert paths(results) == expect(4, set())


TCP = {"ERDMA_TRANSPORT": "tcp", "ERDMA_TRAVERSAL": "stun"}


def test_tcp_ranks_behind_nats_meet_directly(tmp_path):
    """The built-in TCP through NATs: every pair of {no NAT, masquerade} meets from the ports whose mappings
    the ranks learned over TCP, both connecting at once; a rank behind a NAT publishes its own address and
    its mapping, one with none its address only."""
    with NatLab(4, tmp_path, public=frozenset({0})) as lab:
        results = run_job(lab, tmp_path, **TCP)
    assert [r.get("wrong") for r in results] == [0] * 4, results
    assert paths(results) == expect(4, set())
    for rank, r in enumerate(results):
        cands = r["advertised"].split(",")
        assert cands[-1].startswith(f"{lab.wan(rank)}:") and cands[-1].endswith(" srflx"), r
        assert len(cands) == (1 if rank == 0 else 2), r


def test_tcp_cannot_meet_through_a_nat_that_maps_each_destination_anew(tmp_path):
    with NatLab(2, tmp_path, symmetric=frozenset({1})) as lab:
        start = time.monotonic()
        results = run_job(lab, tmp_path, **TCP, ERDMA_TIMEOUTS_CONNECT=str(UNREACHABLE_S))
        took = time.monotonic() - start
    for rank, r in enumerate(results):
        assert f"rank {rank}: rank {1 - rank} was not met at {lab.wan(1 - rank)}:" in r.get("error", ""), r
        assert 'use transport.name = "quic" with a relay' in r["error"], r
    assert took < UNREACHABLE_S + 30  # the connect timeout, not a hang


def test_doctor_tells_what_each_nat_does(tmp_path):
    def doctor(site: int, env: dict[str, str]) -> subprocess.Popen[str]:
        return subprocess.Popen(["ip", "netns", "exec", lab.host(site), sys.executable, "-m", "erdma_core.cli",
                                 "doctor"], env=clean | env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    clean = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    with NatLab(3, tmp_path, symmetric=frozenset({1}), public=frozenset({2})) as lab:
        asked = {k: v for k, v in LAB_RELAY.items() if k != "ERDMA_TRAVERSAL"} | {
            "ERDMA_TRAVERSAL_STUN_SERVER": f"{STUN[0]}:{STUN[1]}",
            "ERDMA_TRAVERSAL_STUN_CLASSIFY_SERVER": f"{RFC3489[0]}:{RFC3489[1]}"}
        running = [doctor(i, asked) for i in range(3)] + [doctor(0, {}), doctor(0, {
            "ERDMA_TRAVERSAL_STUN_SERVER": f"{STUN[0]}:9", "ERDMA_TRAVERSAL_STUN_TIMEOUT": "0.5"})]
        outs = [p.communicate(timeout=90) for p in running]
        done = [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(running, outs, strict=True)]
        said, unset, gone = done[:3], done[3], done[4]
    assert all(s.returncode == 0 for s in said), [(s.returncode, s.stdout + s.stderr) for s in said]
    assert "endpoint-independent mapping: hole punching works" in said[0].stdout
    assert "local address 10.1.0.2:" in said[0].stdout and f"mapped to {lab.wan(0)}:" in said[0].stdout
    assert "symmetric NAT): hole punching cannot work" in said[1].stdout
    classified = "RFC 3489 classification (pystun3, from a socket of its own; diagnostic only): "
    assert classified + "Restric Port NAT" in said[0].stdout and classified + "Symmetric NAT" in said[1].stdout
    assert "no NAT" in said[2].stdout
    assert "TCP port: local address 10.1.0.2:" in said[0].stdout
    assert 'endpoint-independent: the built-in TCP meets peers through it' in said[0].stdout
    assert "TCP cannot meet a peer behind another NAT from here" in said[1].stdout
    assert "no NAT on TCP either" in said[2].stdout
    assert any(f"relay {STUN[0]}:{STUN[1]}: granted relayed address {h}:" in said[1].stdout for h in TURN_HOSTS)
    offered = "a rank here offers it as its last candidate: peers that no direct path reaches within 2.0 s"
    assert offered in said[0].stdout and offered in said[1].stdout
    assert "with this NAT, expect peers behind NATs to need it" in said[1].stdout
    assert "expect" not in said[0].stdout
    assert unset.returncode == 0 and "NAT: not probed (set traversal.stun.server" in unset.stdout
    assert gone.returncode == 1 and f"problem: NAT probe through {STUN[0]}:9: no STUN answer" in gone.stdout




@pytest.mark.parametrize("symmetric, public, always, blocked, relayed", [
    # rank 1 behind a NAT that maps per destination dials rank 0 behind an ordinary one: only the relay joins them
    (frozenset({1}), frozenset(), False, False, True),
    (frozenset({0, 1}), frozenset(), False, False, True),  # both such NATs
    # rank 1 behind such a NAT dials a rank with no NAT: straight through (no classification decides it)
    (frozenset({1}), frozenset({0}), False, False, False),
    # the other way round: rank 0's NAT gives the peer's packets no mapping to enter by
    (frozenset({0}), frozenset({1}), False, False, True),
    # two ordinary NATs, and a firewall between the sites that drops direct traffic: the relay
    (frozenset(), frozenset(), False, True, True),
    (frozenset(), frozenset(), True, False, True),  # relay_when = "always": even where punching works
])
def test_pairs_that_no_direct_path_joins_relay_through_turn(tmp_path, symmetric, public, always, blocked, relayed):
    env = RELAY | ({"ERDMA_TRAVERSAL_STUN_RELAY_WHEN": "always"} if always else {})
    with NatLab(2, tmp_path, symmetric=symmetric, public=public) as lab:
        if blocked:
            lab.block_direct(0, 1)
        results = run_job(lab, tmp_path, **env)
    for r in results:
        assert r.get("wrong") == 0 and r["iters"] == 20, r
        assert any(f"{h}:" in r["advertised"].split(",")[-1] for h in TURN_HOSTS), r  # a relay candidate, last
    assert paths(results) == expect(2, {frozenset({0, 1})} if relayed else set()), results
    for rank, r in enumerate(results):  # a rank with a relayed peer says so (a warning: it reaches stderr)
        said = re.search(rf"rank {rank}: QUIC \(\w+\) paths to its peers: rank {1 - rank} at [0-9.:]+ (\w+)", r["stderr"])
        assert (said is not None and said[1] == "relayed") if relayed else said is None, r["stderr"]
    if relayed and not always:  # the dialler says why it took the relay, checked at once with the mapping
        took = re.search(rf"rank 1: rank 0 at {re.escape(lab.wan(0))}:\d+: no answer within {CHECK_S:.1f} s; ([0-9.]+):\d+ "
                         "answered its check: taken", results[1]["stderr"])
        assert took is not None and took[1] in TURN_HOSTS, results[1]["stderr"]
    if always:
        assert all("because relay_when = 'always'" in r["stderr"] for r in results)


def test_a_direct_path_that_breaks_mid_job_falls_back_to_the_relay(tmp_path):
    with NatLab(2, tmp_path) as lab:
        def break_the_direct_path() -> None:
            started = wait_started(tmp_path, 2)  # connected, and allreducing for 8 s
            assert started == [{"1": "direct"}, {"0": "direct"}], started
            lab.block_direct(0, 1)

        fast = {"ERDMA_TRANSPORT_QUIC_IDLE_TIMEOUT": "2", "ERDMA_TRANSPORT_QUIC_KEEPALIVE_INTERVAL": "0.5",
                "ERDMA_TRANSPORT_QUIC_RECONNECT_TIMEOUT": "20", "ERDMA_TIMEOUTS_COLLECTIVE": "30", "JOB_PAUSE": "0.02"}
        results = run_job(lab, tmp_path, iters=400, count=1000, during=break_the_direct_path, **RELAY, **fast)
    for r in results:
        assert r.get("wrong") == 0 and r["iters"] == 400, r
    assert paths(results) == expect(2, {frozenset({0, 1})}), results  # the job ended on the relay
    assert "no answer from rank 0 at" in results[1]["stderr"] and "on redial; trying" in results[1]["stderr"]
    assert "connection to rank 0 back after" in results[1]["stderr"], results[1]["stderr"]


def test_a_ring_allreduce_keeps_a_relayed_pair_apart(tmp_path):
    """Four sites behind masquerade NATs, a firewall between sites 1 and 2: that pair is relayed, every rank
    agrees on it, and the ring runs 0, 1, 3, 2 (no relayed pair side by side) instead of 0, 1, 2, 3."""
    with NatLab(4, tmp_path) as lab:
        lab.block_direct(1, 2)
        results = run_job(lab, tmp_path, ERDMA_ALGORITHM="ring", **RELAY)
    assert [r.get("wrong") for r in results] == [0] * 4, results
    assert paths(results) == expect(4, {frozenset({1, 2})})
    assert [r["ring"] for r in results] == [[0, 1, 3, 2]] * 4


@pytest.mark.parametrize("symmetric, public, relayed", [
    # fully-random ones dial the rank with no NAT directly; the masquerade one and each other, relayed
    (frozenset({2, 3}), frozenset({0}), {frozenset({1, 2}), frozenset({1, 3}), frozenset({2, 3})}),
    # the other way round: a fully-random rank 0 is dialled by a masquerade one and two with no NAT: relayed
    (frozenset({0}), frozenset({2, 3}), {frozenset({0, 1}), frozenset({0, 2}), frozenset({0, 3})}),
])
def test_four_ranks_of_every_nat_kind_every_pair_connects(tmp_path, symmetric, public, relayed):
    """The matrix in 4-rank jobs: with the job of two public and two masquerade ranks above, every ordered pair
    of {no NAT, masquerade, fully-random} (the higher rank dials) is in a 4-rank allreduce, its path asserted."""
    with NatLab(4, tmp_path, symmetric=symmetric, public=public) as lab:
        results = run_job(lab, tmp_path, **RELAY)
    assert [r.get("wrong") for r in results] == [0] * 4, results
    assert paths(results) == expect(4, relayed)


def test_striping_lanes_each_get_their_own_punched_mapping(tmp_path):
    lanes = {"ERDMA_TRANSPORT_QUIC_WORKERS": "2", "ERDMA_TRANSPORT_QUIC_PART_BYTES": "65536"}
    with NatLab(2, tmp_path) as lab:
        results = run_job(lab, tmp_path, ERDMA_TRAVERSAL="stun", **lanes)
    for r in results:
        assert r.get("wrong") == 0 and r["lane_parts"] > 0, r  # parts went over the lanes' own sockets


def test_striping_with_a_relay_is_refused_clearly(tmp_path):
    lanes = {"ERDMA_TRANSPORT_QUIC_WORKERS": "2"}
    with NatLab(2, tmp_path, symmetric=frozenset({1})) as lab:
        results = run_job(lab, tmp_path, **RELAY, **lanes)
    for r in results:
        assert "ConfigError: config key 'transport.quic.workers': value 2 needs a socket per lane" in r["error"], r
        assert "valid here: 0 (or no relay)" in r["error"]


def test_a_refused_relay_fails_clearly(tmp_path):
    with NatLab(2, tmp_path, symmetric=frozenset({1})) as lab:
        results = run_job(lab, tmp_path, **(RELAY | {"ERDMA_TRAVERSAL_STUN_RELAY_PASSWORD": "wrong",
                                                     "ERDMA_TIMEOUTS_CONNECT": str(UNREACHABLE_S)}))
    assert "the TURN server refused Allocate: error 401" in results[1]["error"], results[1]
    assert "error" in results[0]  # its peer never came


@pytest.mark.parametrize("over_tcp", [False, True])
def test_a_relay_that_dies_mid_job_fails_every_rank_clearly(tmp_path, over_tcp):
    """Over UDP, rank 1 behind a NAT that maps per destination; over TCP, rank 1's site drops UDP (its relay
    connection's end stands for the ICMP error)."""
    with NatLab(2, tmp_path, symmetric=frozenset() if over_tcp else frozenset({1})) as lab:
        if over_tcp:
            lab.block_udp(1)

        def kill_the_relay() -> None:
            wait_started(tmp_path, 2)  # connected, and allreducing
            lab.stop_turn()

        results = run_job(lab, tmp_path, iters=10**6, count=1000, during=kill_the_relay,
                          **(RELAY | {"ERDMA_TIMEOUTS_COLLECTIVE": "20", "ERDMA_TRAVERSAL_STUN_RELAY_OVER":
                                      "tcp" if over_tcp else "udp"}))
    for rank, r in enumerate(results):
        assert r.get("iters", 0) > 0 and "error" in r, r
        assert f"rank {rank}" in r["error"] and "rank " + str(1 - rank) in r["error"], r
        assert "a relay on the way is gone" in r["error"], r


@pytest.mark.parametrize("case, env, symmetric", [
    ("no traversal: private addresses advertised", {"ERDMA_TRAVERSAL": "direct"}, frozenset()),
    ("stun without the punch: the NAT drops the dialler", {"ERDMA_TRAVERSAL": "stun",
                                                          "ERDMA_TRAVERSAL_STUN_PUNCH": "false"}, frozenset()),
    ("a NAT mapping each destination anew (symmetric), no relay", {"ERDMA_TRAVERSAL": "stun"}, frozenset({1})),
])
def test_unreachable_pairs_fail_clearly_and_in_time(tmp_path, case, env, symmetric):
    with NatLab(2, tmp_path, symmetric=symmetric) as lab:
        results = run_job(lab, tmp_path, **env, ERDMA_TIMEOUTS_CONNECT=str(UNREACHABLE_S))
    for rank, r in enumerate(results):
        assert "error" in r, (case, r)
        assert f"rank {rank}: ranks [{1 - rank}] did not connect over QUIC within {UNREACHABLE_S}s" in r["error"], r


PAIRED = RELAY | {"ERDMA_TRANSPORT": "tcp", "ERDMA_TRANSPORT_FALLBACK": "quic"}


def relayed_path(tmp: Path, rank: int, timeout: float = CONNECT_S + 60) -> None:
    """Wait until ``rank`` of the job ``run_job(lab, tmp, ...)`` runs has published a path through the relay
    (erdma-quic publishes ``paths/RANK`` again when a link comes back, in the job's file store)."""
    from erdma_core.testing import FileStore

    store, end = FileStore(str(tmp / "store")), time.monotonic() + timeout
    while " relayed" not in _read(store, f"paths/{rank}"):
        if time.monotonic() > end:
            raise RuntimeError(f"rank {rank} published no relayed path within {timeout:.0f}s")
        time.sleep(0.1)


def _read(store: object, key: str) -> str:
    try:
        return store.get(key, 0.01).decode()  # type: ignore[attr-defined]
    except Exception:  # not there yet
        return ""


def transports(results: list[dict]) -> dict[tuple[int, int], str]:
    """(rank, peer) -> the transport that carries the pair, as each rank reported it."""
    return {(rank, int(peer)): name for rank, r in enumerate(results) for peer, name in r["transports"].items()}


def test_a_tcp_job_with_a_relay_puts_each_pair_on_its_own_path(tmp_path):
    """Four sites, the last behind a NAT that maps each destination anew: the job is configured for TCP with
    QUIC as the fallback and a TURN relay. The three pairs among the ordinary NATs meet over kernel TCP; the
    symmetric site's three pairs cannot, and go over QUIC through the relay. One group, every allreduce exact.
    Both transports check every pair at once: the symmetric rank had its relay allocation (QUIC's socket) before
    its TCP gave up its pairs (one check timeout, 3 s here), and the other ranks' QUIC let go of the pairs TCP
    met."""
    env = PAIRED | {"ERDMA_DEBUG": "INFO", "ERDMA_TRAVERSAL_STUN_CHECK_TIMEOUT": "3", "ERDMA_TIMEOUTS_CONNECT": "20"}
    with NatLab(4, tmp_path, symmetric=frozenset({3})) as lab:
        results = run_job(lab, tmp_path, **env)
    assert [r.get("wrong") for r in results] == [0] * 4, results
    lines = results[3]["stderr"].splitlines()
    allocated = [i for i, line in enumerate(lines) if "relay allocation " in line]
    gave_up = [i for i, line in enumerate(lines) if "rank 3: not met over TCP" in line]
    taken = [line for line in lines if re.search(r"rank 3: rank \d at .*answered its check: taken", line)]
    assert len(allocated) == 1 and len(gave_up) == 1 and allocated[0] < gave_up[0] and len(taken) == 3, lines
    for rank in range(3):
        mine = f"rank {rank}: QUIC lets go of ranks {[p for p in range(3) if p != rank]}"
        assert mine in results[rank]["stderr"], results[rank]["stderr"]
    relayed = {frozenset({0, 3}), frozenset({1, 3}), frozenset({2, 3})}
    assert paths(results) == expect(4, relayed), results
    assert transports(results) == {pair: "QUIC" if how == "relayed" else "TCP"
                                   for pair, how in expect(4, relayed).items()}, results
    for rank, r in enumerate(results):
        counts = {k: v for k, v in r["counters"].items() if k.startswith("transport.")}
        assert counts == ({"transport.tcp.peers": 2, "transport.quic.peers": 1, "transport.relayed.peers": 1}
                          if rank < 3 else {"transport.tcp.peers": 0, "transport.quic.peers": 3,
                                            "transport.relayed.peers": 3}), (rank, counts)


def test_a_rank_lost_on_one_transport_fails_the_ranks_that_reach_it_only_on_the_other(tmp_path):
    """The job above; rank 1 dies mid-job. Ranks 0 and 2 lose it over TCP; rank 3 reaches rank 1 over QUIC, and
    every survivor fails with an error naming rank 1, within the collective timeout, none hanging."""
    with NatLab(4, tmp_path, symmetric=frozenset({3})) as lab:
        results = run_job(lab, tmp_path, iters=400, count=1000, JOB_EXIT="1:50", JOB_PAUSE="0.01",
                          ERDMA_TIMEOUTS_COLLECTIVE="20", **PAIRED)
    assert results[1] == {"exited": True, "stderr": results[1]["stderr"]}, results[1]
    for rank in (0, 2, 3):
        r = results[rank]
        assert r["iters"] == 50 and "rank 1" in r["error"], (rank, r)
        assert r["error"].startswith("PeerLostError: "), (rank, r)  # told of the loss, not timed out


IDLE_RELAY = """
import sys, time
from erdma_p2p.traversal import StunTraversal
idle, sender = float(sys.argv[1]), sys.argv[2]
section = {"server": "%s", "timeout": 5.0, "bind_address": "", "punch": True, "port": 0, "check_server": "",
           "relay": "%s", "relay_user": "%s", "relay_password": "%s", "relay_when": "fallback",
           "check_timeout": 2.0, "classify_server": "", "relay_over": "udp"}
t = StunTraversal(None, section)
sock = t.udp_socket()
print(t.relayed.host, t.relayed.port, flush=True)
end = time.monotonic() + idle
while time.monotonic() < end:  # a transport's traffic to a peer reached directly, as keepalives would be
    sock.sendto(b"\\0direct", (sender, 9))
    time.sleep(1.0)
sock.permit(sender)  # what a set-up does for a peer that dials this rank
sock.setblocking(False)
print("listening", flush=True)
got, end = 0, time.monotonic() + 60.0
while got < 60 and time.monotonic() < end:
    try:
        got += sock.recvfrom(65536)[0].startswith(b"hello")
    except BlockingIOError:
        time.sleep(0.02)
print(got, sock.client.denied, flush=True)
"""


def test_a_relay_allocation_behind_a_symmetric_nat_still_reaches_its_rank_after_40_s_of_nothing_relayed(tmp_path):
    """A rank behind a NAT that maps each destination anew holds a relay allocation that carries nothing for
    40 s (its peers are reached directly meanwhile): the NAT would forget the socket's binding to the TURN server
    after 30 s, and the allocation would then relay into nothing. The relay client's keepalive (a Binding
    indication when nothing else went to the server for 15 s) holds the binding: a peer that then sends to
    the relayed address reaches the rank, all 60 datagrams of it."""
    from erdma_p2p.lab.natlab import TURN_PASSWORD, TURN_USER

    code = IDLE_RELAY % (f"{STUN[0]}:{STUN[1]}", f"{STUN[0]}:{STUN[1]}", TURN_USER, TURN_PASSWORD)
    with NatLab(2, tmp_path, symmetric=frozenset({1})) as lab:
        rank = subprocess.Popen(["ip", "netns", "exec", lab.host(1), sys.executable, "-c", code, "40", lab.wan(0)],
                                stdout=subprocess.PIPE, text=True)
        host, port = rank.stdout.readline().split()
        assert rank.stdout.readline() == "listening\n"  # after its 40 s (bounded by the rank's own loop)
        send = (f"import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"for i in range(60):\n    s.sendto(b'hello %d' % i, ({host!r}, {port}))\n    time.sleep(0.1)\n")
        subprocess.run(["ip", "netns", "exec", lab.host(0), sys.executable, "-c", send], check=True, timeout=30)
        out = rank.communicate(timeout=90)[0]
    assert out.strip() == "60 {}", out


# a pair whose path breaks falls back within 2 s of silence, and checks its better path every second
MOVES = {"ERDMA_TRANSPORT_QUIC_IDLE_TIMEOUT": "2", "ERDMA_TRANSPORT_QUIC_KEEPALIVE_INTERVAL": "0.5",
         "ERDMA_TRANSPORT_QUIC_RECONNECT_TIMEOUT": "20", "ERDMA_TRANSPORT_QUIC_PATH_RECHECK": "1",
         "ERDMA_TIMEOUTS_COLLECTIVE": "30", "JOB_PAUSE": "0.01"}


def test_a_direct_path_blocked_mid_job_falls_back_and_unblocked_is_used_again(tmp_path):
    """Two sites behind masquerade NATs, a direct pair. A firewall between them mid-job: the pair falls back to
    the relay. The firewall lifted: the dialling rank's next check of the better path (path_recheck, 1 s here)
    completes a handshake at the peer's mapping and the pair moves back, while the allreduces go on. Every one
    of the 1,500 allreduces is exact, none fails, and the job ends direct."""
    with NatLab(2, tmp_path) as lab:
        def block_then_lift() -> None:
            assert wait_started(tmp_path, 2) == [{"1": "direct"}, {"0": "direct"}]
            lab.block_direct(0, 1)
            relayed_path(tmp_path, 1)  # the idle timeout (2 s) ended the connection; the redial found the relay
            lab.unblock_direct(0, 1)

        results = run_job(lab, tmp_path, iters=1500, count=1000, during=block_then_lift, **RELAY, **MOVES)
    for r in results:
        assert r.get("wrong") == 0 and r["iters"] == 1500, r
    assert paths(results) == expect(2, set()), results  # back on the direct path
    said = results[1]["stderr"]
    assert "on redial; trying" in said and "connection to rank 0 back after" in said, said  # fell back
    assert re.search(r"rank 1: rank 0 answered at 198\.51\.100\.10:\d+, a better path than 198\.51\.100\.[12]:\d+; "
                     r"the pair moved there", said), said  # (coturn relays from either of its addresses)


def test_a_paired_jobs_quic_pair_that_changes_path_mid_job_is_published_again(tmp_path):
    """A TCP job with QUIC as the fallback, two masquerade sites whose routers drop TCP between them: the pair
    goes to QUIC, direct. Then UDP between them is dropped too: QUIC falls back to the relay, and the job's
    ``paths/RANK`` (which the paired transport writes, for erdma doctor) says so; lifted, the pair moves back,
    and the allreduces go on exact throughout."""
    with NatLab(2, tmp_path) as lab:
        lab.block_direct(0, 1, "tcp")

        def block_then_lift() -> None:
            assert wait_started(tmp_path, 2) == [{"1": "direct"}, {"0": "direct"}]
            lab.block_direct(0, 1, "udp")
            relayed_path(tmp_path, 1)  # the paired transport published QUIC's new path
            lab.unblock_direct(0, 1, "udp")

        results = run_job(lab, tmp_path, iters=1500, count=1000, during=block_then_lift, **PAIRED, **MOVES)
    for r in results:
        assert r.get("wrong") == 0 and r["iters"] == 1500, r
    assert transports(results) == {(0, 1): "QUIC", (1, 0): "QUIC"}, results
    assert paths(results) == expect(2, set()), results  # back on the direct path
    assert "the pair moved there" in results[1]["stderr"], results[1]["stderr"]


@pytest.mark.parametrize("over", ["auto", "tcp", "tls", "auto-tls"])
def test_a_site_that_drops_udp_joins_through_turn_over_tcp(tmp_path, over):
    """Site 1's router drops all UDP. With relay_over = "auto" its STUN question over UDP goes unanswered (2 s),
    and it takes its relay allocation over TCP (with "tcp", at once; with "tls", over TLS to coturn's TLS port,
    its certificate checked against the bed's CA; "auto-tls": auto at a site that also drops TCP to port 3478,
    so TLS after TCP fails); the pair runs through the relay, the allreduces exact. Rank 0's side is as usual
    (UDP, its own relay unused)."""
    with NatLab(2, tmp_path) as lab:
        env = RELAY | {"ERDMA_TRAVERSAL_STUN_TIMEOUT": "2", "ERDMA_TRAVERSAL_STUN_RELAY_OVER": over.split("-")[0],
                       "ERDMA_TRAVERSAL_STUN_RELAY_CA": str(lab.turn_ca)}
        lab.block_udp(1)
        if over == "auto-tls":
            lab.block_port(1, "tcp", 3478)
        results = run_job(lab, tmp_path, **env)
    for r in results:
        assert r.get("wrong") == 0 and r["iters"] == 20, r
    assert paths(results) == expect(2, {frozenset({0, 1})}), results
    said = results[1]["stderr"]
    how = "TLS" if "tls" in over else "TCP"
    port = 5349 if how == "TLS" else 3478
    assert f"relayed over {how}: every peer goes through the TURN server 198.51.100.1:{port}" in said, said
    assert ("no STUN answer" in said) == over.startswith("auto"), said
    assert ("no TCP connection" in said) == (over == "auto-tls"), said
    assert results[1]["advertised"].endswith(" relay") and "," not in results[1]["advertised"], results[1]


def test_turn_over_tls_refuses_a_server_whose_certificate_it_cannot_check(tmp_path):
    """relay_over = "tls" with a CA that did not sign coturn's certificate: each rank fails at set-up, before it
    allocates anything on that server, with a TurnError naming the server, the CA setting and the TLS error."""
    certs.authority(tmp_path, "other-ca")
    with NatLab(2, tmp_path) as lab:
        lab.block_udp(1)
        results = run_job(lab, tmp_path, **RELAY, ERDMA_TRAVERSAL_STUN_RELAY_OVER="tls",
                          ERDMA_TRAVERSAL_STUN_RELAY_CA=str(tmp_path / "other-ca.pem"))
    for r in results:
        err = r.get("error", "")
        assert err.startswith("TurnError: TURN server 198.51.100.1:5349: its TLS certificate was not accepted "
                              f"(traversal.stun.relay_ca = '{tmp_path / 'other-ca.pem'}')"), r
        assert "CERTIFICATE_VERIFY_FAILED" in err, r


def test_a_rank_whose_pairs_all_meet_over_tcp_agrees_on_the_slow_links_with_the_others(tmp_path):
    """Site 0 public, site 3 behind a NAT that maps each destination anew: rank 3's SYN reaches rank 0's listener,
    so rank 0 meets everyone over TCP and opens no QUIC; ranks 1 and 2 reach rank 3 only through the relay. The
    ranks still agree on the slow (relayed) links at set-up, and the ring keeps them apart."""
    with NatLab(4, tmp_path, public=frozenset({0}), symmetric=frozenset({3})) as lab:
        results = run_job(lab, tmp_path, ERDMA_ALGORITHM="ring", **PAIRED)
    assert [r.get("wrong") for r in results] == [0] * 4, results
    relayed = {frozenset({1, 3}), frozenset({2, 3})}
    assert paths(results) == expect(4, relayed), results
    assert transports(results) == {pair: "QUIC" if how == "relayed" else "TCP"
                                   for pair, how in expect(4, relayed).items()}, results
    assert results[0]["counters"]["transport.tcp.peers"] == 3 and "transport.quic.peers" not in results[0]["counters"]
    assert len({tuple(r["ring"]) for r in results}) == 1, results  # one ring order, agreed


def test_a_lower_rank_behind_a_nat_that_maps_each_destination_anew_meets_a_public_one_over_tcp(tmp_path):
    """Rank 0 behind a NAT that maps each destination to a new port, rank 1 public: rank 0's SYN reaches rank 1's
    listener from a port rank 0 never published, and rank 1's SYN to rank 0's mapping is dropped. Rank 1 knows
    the connection as rank 0's meeting by its host (no other peer is there) and dials the job's handshake on
    it, so the pair runs on kernel TCP, not relayed (before, each end waited for the other to prove itself)."""
    with NatLab(2, tmp_path, public=frozenset({1}), symmetric=frozenset({0})) as lab:
        results = run_job(lab, tmp_path, **PAIRED)
    assert [r.get("wrong") for r in results] == [0] * 2, results
    assert paths(results) == expect(2, set()), results
    assert transports(results) == {(0, 1): "TCP", (1, 0): "TCP"}, results
