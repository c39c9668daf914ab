"""The ``dht`` discovery: signed records, request checks, and real Kademlia nodes on loopback (``erdma dht
serve`` processes and in-process nodes): jobs that find each other through them, foreign and forged records
ignored, the newest of stale copies, a dead node, a job name used again, and the errors a user sees."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from erdma_p2p import records
from erdma_p2p.dht import DhtNode, _Storage, _valid
from erdma_p2p.dht_store import DhtStore, dht_store, parse_url
from erdma_p2p.lab.natlab import first_line

from erdma_core.sdk import CollectiveTimeoutError, ConfigError, ErdmaError

KEYS = records.JobKeys(b"secret", "job")
KEY = KEYS.dht_key("quic/addr/1")
SECTION = {"port": 0, "bind_address": "127.0.0.1", "rpc_timeout": 0.5, "ttl": 60.0, "poll_max": 0.1}
JOB = """
import sys, numpy as np, erdma_core
pg = erdma_core.init()
p, r = pg.size(), pg.rank()
a = (np.arange(1000, dtype=np.float32) * (r + 1)) % 97
pg.allreduce(a)
want = sum((np.arange(1000, dtype=np.float32) * (k + 1)) % 97 for k in range(p)).astype(np.float32)
print(("ok" if np.array_equal(a, want) else "WRONG") + f" {r}", flush=True)
pg.destroy()
"""


def test_a_record_opens_only_with_its_job_key_and_dht_key_until_it_expires():
    blob = KEYS.seal("quic/addr/1", b"198.51.100.1:4000", 7, time.time() + 60)
    assert KEYS.unseal("quic/addr/1", blob, time.time()) == (7, pytest.approx(time.time() + 60, abs=5), False,
                                                              b"198.51.100.1:4000")
    assert b"198.51.100.1" not in blob  # the value travels and rests encrypted
    assert records.JobKeys(b"other", "job").unseal("quic/addr/1", blob, time.time()) is None  # another job's keys
    assert KEYS.unseal("quic/addr/2", blob, time.time()) is None  # replayed under another key
    assert KEYS.unseal("quic/addr/1", blob, time.time() + 61) is None  # expired
    for i in (5, 20, 60, 80, len(blob) - 1):
        bad = bytearray(blob)
        bad[i] ^= 1
        assert KEYS.unseal("quic/addr/1", bytes(bad), time.time()) is None


def test_the_highest_valid_version_wins_and_a_tombstone_reads_as_deleted():
    now = time.time()
    old, new = (KEYS.seal("k", v, ver, now + 60) for v, ver in ((b"old", 1), (b"new", 2)))
    forged = records.JobKeys(b"evil", "job").seal("k", b"evil", 99, now + 60)
    assert KEYS.latest("k", [old, forged, new, b"junk", 5], now).value == b"new"
    gone = KEYS.seal("k", b"", 3, now + 60, deleted=True)
    assert KEYS.latest("k", [new, gone], now).deleted
    assert KEYS.latest("k", [], now) is None


@pytest.mark.parametrize("blob", [b"", records.MAGIC + b"\0" * 40, "text", 12,
                                  records.MAGIC + b"\0" * (records.MAX_RECORD + 1)])
def test_dht_nodes_store_only_what_is_shaped_like_a_record(blob):
    assert not records.shape_ok(blob)
    assert not _valid("store", [b"n" * 20, b"k" * 20, blob], stores=True)


def test_a_dht_node_stores_only_records_signed_for_their_key_and_keeps_the_newest():
    """What a DHT node checks with no job's secret: the record's key is the address of its public key and
    salt, and the signature holds. So nobody can overwrite the job's records, and an old one sent again does
    not replace a newer one."""
    storage = _Storage(100, 3600.0, 100)
    now = time.time()
    v1, v2 = KEYS.seal("k", b"one", 1, now + 60), KEYS.seal("k", b"two", 2, now + 60)
    dkey = KEYS.dht_key("k")
    assert storage.put(dkey, v2, "10.0.0.1") and storage.get(dkey) == v2
    assert not storage.put(dkey, v1, "10.0.0.9") and storage.get(dkey) == v2  # older: kept out
    evil = records.JobKeys(b"evil", "job")
    assert not storage.put(dkey, evil.seal("k", b"x", 99, now + 60), "10.0.0.9")  # signed for another key
    forged = bytearray(KEYS.seal("k", b"three", 3, now + 60))
    forged[-1] ^= 1
    assert not storage.put(dkey, bytes(forged), "10.0.0.9")  # a signature that does not hold
    assert not storage.put(KEYS.dht_key("other"), v2, "10.0.0.9")  # under another key
    assert not storage.put(dkey, KEYS.seal("k", b"gone", 5, now - 1), "10.0.0.9")  # expired
    assert storage.get(dkey) == v2


def test_what_one_address_stores_is_bounded_and_a_flood_churns_only_its_own():
    storage = _Storage(limit=50, ttl=3600.0, per_source=20)
    now = time.time()
    mine = [KEYS.seal(f"k{i}", b"v", 1, now + 60) for i in range(5)]
    for i, blob in enumerate(mine):
        assert storage.put(KEYS.dht_key(f"k{i}"), blob, "10.0.0.1")
    evil = [records.JobKeys(b"evil", f"flood{a}") for a in range(4)]
    for i in range(400):  # 4 addresses, each its own job with valid records, 100 each
        keys = evil[i % 4]
        storage.put(keys.dht_key(f"x{i}"), keys.seal(f"x{i}", b"f", 1, now + 60), f"10.6.6.{i % 4}")
    assert all(storage.get(KEYS.dht_key(f"k{i}")) == blob for i, blob in enumerate(mine))
    assert len(storage.data) <= 50


def test_requests_are_checked_before_they_are_served():
    good = KEYS.seal("k", b"v", 1, time.time() + 60)
    assert _valid("store", [b"n" * 20, b"k" * 20, good], stores=True)
    assert not _valid("store", [b"n" * 20, b"k" * 20, good], stores=False)  # a client keeps nothing for others
    assert _valid("find_value", [b"n" * 20, b"k" * 20], stores=True)
    for args in ([b"n" * 20], [b"n" * 19, b"k" * 20], ["n" * 20, b"k" * 20], [b"n" * 20, 5], "ab"):
        assert not _valid("find_value", args, stores=True)
    assert not _valid("ping", [b"n" * 21], stores=True)


def test_a_record_too_large_is_refused_when_sealed():
    with pytest.raises(ValueError, match="a DHT record holds at most"):
        KEYS.seal("k", b"x" * records.MAX_RECORD, 1, time.time() + 60)


@pytest.fixture
def servers() -> Iterator[list[DhtNode]]:
    first = DhtNode(server=True, rpc_timeout=0.5)
    addr = first.start("127.0.0.1", 0, [], 5.0)
    nodes = [first] + [DhtNode(server=True, rpc_timeout=0.5) for _ in range(2)]
    for n in nodes[1:]:
        n.start("127.0.0.1", 0, [addr], 5.0)
    yield nodes
    for n in nodes:
        n.stop()


def _addrs(nodes: list[DhtNode]) -> list[tuple[str, int]]:
    return [n.server.transport.get_extra_info("sockname")[:2] for n in nodes]


def test_stores_of_one_job_meet_and_other_jobs_and_secrets_see_nothing(servers):
    a = DhtStore(_addrs(servers[:1]), "job", b"secret", timeout=5.0, section=SECTION)
    b = DhtStore(_addrs(servers[2:]), "job", b"secret", timeout=5.0, section=SECTION)
    stranger = DhtStore(_addrs(servers[1:2]), "job", b"another secret", timeout=5.0, section=SECTION)
    other_job = DhtStore(_addrs(servers[1:2]), "job2", b"secret", timeout=5.0, section=SECTION)
    try:
        a.set("quic/addr/0", b"10.0.0.1:4000")
        assert b.get("quic/addr/0", 5.0) == b"10.0.0.1:4000"
        for s in (stranger, other_job):
            with pytest.raises(CollectiveTimeoutError, match="discovery: key 'quic/addr/0' did not appear in the DHT"):
                s.get("quic/addr/0", 0.5)
        assert b.add("erdma/joined/1", 1) == 1 and b.add("erdma/joined/1", 0) == 1 and a.add("erdma/joined/1", 1) == 2
        assert a.add("erdma/joined/1", 0) == 2 and b.add("erdma/joined/1", 0) == 2
    finally:
        for s in (a, b, stranger, other_job):
            s.close()


@pytest.mark.parametrize("serve", [True, False])
def test_ranks_that_serve_keep_the_jobs_records_when_every_bootstrap_node_is_gone(serve):
    boot = DhtNode(server=True, rpc_timeout=0.5)
    addr = boot.start("127.0.0.1", 0, [], 5.0)
    section = {**SECTION, "serve": serve, "max_records": 64, "per_source": 32}
    stores = [DhtStore([addr], "job", b"secret", timeout=5.0, section=section) for _ in range(3)]
    try:
        stores[0].set("before", b"1")
        assert stores[1].add("joined", 1) == 1
        boot.stop()
        if not serve:  # client nodes hold nothing: with the bootstrap node gone the records are gone
            with pytest.raises(CollectiveTimeoutError, match="'before' did not appear"):
                stores[2].get("before", 2.0)
            return
        assert stores[2].get("before", 10.0) == b"1"
        stores[1].set("after", b"2")
        assert stores[0].get("after", 10.0) == b"2"
        assert stores[2].add("joined", 1) == 2 and stores[0].add("joined", 0) == 2
    finally:
        for s in stores:
            s.close()
        boot.stop()


def test_a_set_that_lost_to_a_newer_write_of_another_process_lets_it_stand(servers):
    a, b = (DhtStore(_addrs(servers), "race-set", b"secret", timeout=5.0, section=SECTION) for _ in range(2))
    try:
        b._mine["finished"] = (time.time_ns() + 10**12, b"")  # b's clock is ahead: its write is newer
        b.set("finished", b"40")
        a.set("finished", b"41")  # every node refuses it: b's version is newer
        assert a.get("finished", 5.0) == b"40" and b.get("finished", 5.0) == b"40"
    finally:
        a.close()
        b.close()


def test_a_share_of_a_counter_lost_to_a_racing_write_comes_back(servers):
    """Two processes that both claim rank 1 add 1 at once; the later write drops the other's share. The
    other's next add (the core's duplicate check adds 0) writes it back, and both then count 2."""
    a, b = (DhtStore(_addrs(servers), "race", b"secret", timeout=5.0, section=SECTION) for _ in range(2))
    try:
        assert a.add("erdma/joined/j/1", 1) == 1
        b._added["erdma/joined/j/1"] = 1  # b read the counter before a wrote, then wrote its own share only
        b._write("erdma/joined/j/1", f"{b._token}=1".encode())
        assert a.add("erdma/joined/j/1", 0) == 2 and b.add("erdma/joined/j/1", 0) == 2
    finally:
        a.close()
        b.close()


def _forget_everything(nodes: list[DhtNode]) -> None:
    """Every node loses what it held, as nodes that left and came back empty (on each node's loop)."""
    async def clear(node: DhtNode) -> None:
        node.server.storage.data.clear()
        node.server.storage._of.clear()

    for n in nodes:
        n.run(clear(n), 5.0)


def test_a_counter_the_dht_lost_is_written_back_by_a_process_that_read_it(servers):
    """Every node that held a counter is gone (they came back empty); a newcomer's add would count from 1
    again. A process that read the counter before writes back the shares it saw, with its next add."""
    a, b, c = (DhtStore(_addrs(servers), "lost-count", b"secret", timeout=5.0, section=SECTION) for _ in range(3))
    try:
        assert a.add("tickets", 1) == 1 and b.add("tickets", 1) == 2 and a.add("tickets", 0) == 2
        _forget_everything(servers)
        assert c._read("tickets") is None
        assert a.add("tickets", 0) == 2  # a saw b's share: both come back
        assert c.add("tickets", 1) == 3
        assert b.add("tickets", 0) == 3
    finally:
        for s in (a, b, c):
            s.close()


def test_a_key_the_dht_lost_reads_as_this_process_wrote_it_and_a_kept_one_comes_back_for_all(servers, monkeypatch):
    import erdma_p2p.dht_store as dht_store_module

    monkeypatch.setattr(dht_store_module, "KEEP_S", 0.2)
    a, b = (DhtStore(_addrs(servers), "lost-key", b"secret", timeout=5.0, section=SECTION) for _ in range(2))
    try:
        a.set("finished", b"40")
        a.set("mesh/a", b"10.0.0.1 4000")
        a.keep("mesh/a")
        _forget_everything(servers)
        assert a.get("finished", 0.0) == b"40"  # its own write
        with pytest.raises(CollectiveTimeoutError, match="did not appear in the DHT"):
            b.get("finished", 0.3)  # nobody keeps it
        assert b.get("mesh/a", 5.0) == b"10.0.0.1 4000"  # written again within KEEP_S
    finally:
        a.close()
        b.close()
    assert a._keeper is not None and not a._keeper.is_alive()


def test_an_add_refused_for_a_newer_version_merges_with_it_also_from_a_clock_ahead(servers):
    """b's host clock is 1000 s ahead, so its record's version is above any a would pick from its own clock:
    the nodes refuse a's write until a writes above the version it read. Four processes adding at once all
    succeed, and every share is counted."""
    a, b = (DhtStore(_addrs(servers), "ahead", b"secret", timeout=5.0, section=SECTION) for _ in range(2))
    racers = [DhtStore(_addrs(servers), "ahead", b"secret", timeout=5.0, section=SECTION) for _ in range(4)]
    try:
        b._added["c"] = 1
        b._write("c", f"{b._token}=1".encode(), after=time.time_ns() + 10**12)
        assert a.add("c", 1) == 2 and b.add("c", 0) == 2
        with ThreadPoolExecutor(4) as pool:
            assert all(n >= 1 for n in pool.map(lambda s: s.add("d", 1), racers))
        assert [s.add("d", 0) for s in racers][-1] == 4
        assert {s.add("d", 0) for s in racers} == {4}
    finally:
        for s in (a, b, *racers):
            s.close()


def test_forged_and_stale_copies_lose_to_the_newest_signed_record(servers):
    """Nodes that answer with an old copy, or with anything at all (a node that is not honest), do not win over
    the newest record another node holds."""
    store = DhtStore(_addrs(servers[:1]), "job", b"secret", timeout=5.0, section=SECTION)
    try:
        store.set("k", b"first")
        store.set("k", b"second")
        keys = records.JobKeys(b"secret", "job")
        dkey = keys.dht_key("k")
        stale = keys.seal("k", b"first", 1, time.time() + 60)
        forged = records.JobKeys(b"evil", "job").seal("k", b"evil", 2**63, time.time() + 60)
        for node, blob in ((servers[1], stale), (servers[2], forged)):  # what those nodes answer with
            node.server.storage.data[dkey] = (time.monotonic(), blob, "x", 0, time.time() + 60)
        assert store.get("k", 2.0) == b"second"
    finally:
        store.close()


def test_a_closed_job_leaves_tombstones_so_its_name_can_be_used_again(servers):
    first = DhtStore(_addrs(servers), "run", b"secret", timeout=5.0, section=SECTION)
    first.set("erdma/job", b"1:2:mac")
    first.close()
    again = DhtStore(_addrs(servers), "run", b"secret", timeout=5.0, section=SECTION)
    try:
        with pytest.raises(CollectiveTimeoutError):
            again.get("erdma/job", 0.5)
    finally:
        again.close()


def test_a_process_with_no_rank_claims_the_lowest_free_one_and_a_full_job_refuses_it(servers):
    stores = [DhtStore(_addrs(servers), "claims", b"secret", timeout=5.0, section=SECTION) for _ in range(3)]
    try:
        assert [s.assign(2, 10.0, settle=0.05) for s in stores[:2]] == [0, 1]
        with pytest.raises(ErdmaError, match=r"all 2 ranks of job 'claims' are claimed"):
            stores[2].assign(2, 10.0, settle=0.05)
    finally:
        for s in stores:
            s.close()


def test_nobody_to_join_fails_at_once_naming_the_nodes():
    with pytest.raises(ErdmaError, match=r"could not join the DHT through 127.0.0.1:9: no DHT bootstrap node answered"):
        DhtStore([("127.0.0.1", 9)], "job", b"secret", timeout=5.0, section=SECTION)


@pytest.mark.parametrize("url, message", [
    ("dht://127.0.0.1:4222", "needs bootstrap nodes and a job name: dht://HOST:PORT[,HOST:PORT...]/JOB"),
    ("dht://127.0.0.1/job", "bootstrap node '127.0.0.1' in 'dht://127.0.0.1/job' is not HOST:PORT"),
    ("dht://127.0.0.1:4222,host.invalid:1/job", "bootstrap host 'host.invalid' does not resolve"),
])
def test_bad_urls_are_refused_naming_the_key(url, message):
    with pytest.raises(ConfigError, match=re.escape("config key 'discovery.init_method'")) as err:
        parse_url(url)
    assert message in str(err.value)


def test_the_job_secret_is_required():
    class Config(dict):
        def section(self, name: str) -> dict:
            return SECTION

    with pytest.raises(ConfigError, match=re.escape("config key 'security.secret': the dht:// discovery signs")):
        dht_store("dht://127.0.0.1:4222/job", 0, 2, 5.0, Config({"security.secret": ""}))


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(port: int, bootstrap: str = "", extra: list[str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "erdma_core.cli", "dht", "serve", "--bind", "127.0.0.1", "--port", str(port),
           *(extra or [])]
    proc = subprocess.Popen(cmd + (["--bootstrap", bootstrap] if bootstrap else []), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    line = first_line(proc, 15.0)
    assert f"erdma dht serve: serving on 127.0.0.1:{port}" in line, line
    return proc


def _job(url: str, world: int, tmp: Path, ranks: bool = True, during: Callable[[], None] | None = None,
         after_first: Callable[[], None] | None = None) -> list[str]:
    """Run JOB on ``world`` ranks; ``after_first`` is called once rank 0 is started, before the others are."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    env |= {"WORLD_SIZE": str(world), "ERDMA_INIT_METHOD": url, "ERDMA_SECRET": "dht-test",
            "ERDMA_TIMEOUTS_CONNECT": "30"}
    script = tmp / "job.py"
    script.write_text(JOB)
    procs = []
    for r in range(world):
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env | ({"RANK": str(r)} if ranks else {}),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        if r == 0 and after_first is not None:
            after_first()
    if during is not None:
        during()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=90)
        out.append(stdout.strip() or stderr.strip()[-800:])
    return out


def test_ranks_find_each_other_through_served_nodes_also_when_one_dies(tmp_path):
    ports = [_free_udp_port(), _free_udp_port()]
    first = _serve(ports[0])
    second = _serve(ports[1], f"127.0.0.1:{ports[0]}")
    url = f"dht://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    try:
        assert _job(f"{url}/run-1", 3, tmp_path) == ["ok 0", "ok 1", "ok 2"]
        assert _job(f"{url}/run-1", 2, tmp_path) == ["ok 0", "ok 1"]  # the same name again, after a clean end
        claimed = _job(f"{url}/run-2", 4, tmp_path, ranks=False)  # no RANK: each process claims one
        assert sorted(claimed) == ["ok 0", "ok 1", "ok 2", "ok 3"], claimed

        def kill_first() -> None:
            time.sleep(0.7)  # the ranks are joining, publishing and reading (imports take about 0.5 s)
            first.kill()
            first.wait(10)

        assert _job(f"{url}/run-3", 3, tmp_path, during=kill_first) == ["ok 0", "ok 1", "ok 2"]  # a node died
        assert _job(f"{url}/run-4", 2, tmp_path) == ["ok 0", "ok 1"]  # and stays dead
    finally:
        for p in (first, second):
            p.terminate()
            p.wait(10)


def test_a_call_whose_caller_stopped_waiting_leaves_nothing_behind() -> None:
    """A read's wait runs out before the node's own RPC timeout (it cancels the call): when that timeout comes,
    the call's entry goes and nothing is raised on the loop (rpcudp set a result on the cancelled future, an
    InvalidStateError on the loop for every such call, and kept the entry for the node's life)."""

    errors: list[dict[str, Any]] = []
    node = DhtNode(server=True, rpc_timeout=0.5)
    try:
        node.start("127.0.0.1", 0, [], 5.0)
        node.loop.call_soon_threadsafe(node.loop.set_exception_handler, lambda loop, ctx: errors.append(ctx))
        silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # takes datagrams, never answers
        silent.bind(("127.0.0.1", 0))
        protocol = node.server.protocol

        async def ping() -> Any:
            return await protocol.ping(silent.getsockname(), node.server.node.id)

        for _ in range(5):
            with pytest.raises(TimeoutError):
                node.run(ping(), 0.05)
        time.sleep(1.5)  # past the node's own timeout of each call
        assert protocol._outstanding == {} and errors == [], (len(protocol._outstanding), errors[:1])
        silent.close()
    finally:
        node.stop()
