"""The DHT lookup that does not wait for slow nodes (``lookup``): the state machine on made-up time, and real
Kademlia nodes on loopback where a node the others still name has gone silent."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from erdma_p2p import records
from erdma_p2p.dht import DhtNode
from erdma_p2p.lookup import GRACE_MIN, Lookup, Rtt
from kademlia.node import Node

TARGET = 0
KEYS = records.JobKeys(b"secret", "job")
KEY = KEYS.dht_key("quic/addr/1")


def _node(n: int) -> Node:
    return Node(n.to_bytes(20, "big"), "127.0.0.1", 10000 + n)


def test_a_question_unanswered_for_grace_stops_counting_and_the_lookup_ends_without_it():
    look = Lookup(TARGET, [_node(n) for n in (1, 2, 3, 4)], k=3, alpha=2, grace=0.2)
    assert [n.long_id for n in look.to_ask(0.0)] == [1, 2]  # the nearest first, alpha at a time
    assert look.to_ask(0.05) == []  # both still fresh
    look.answered(_node(2), [_node(5)])
    assert [n.long_id for n in look.to_ask(0.06)] == [3]  # node 1 is still fresh: one more
    assert look.wake(0.06) == pytest.approx(0.2)  # node 1 turns late then
    look.answered(_node(3), [])
    assert not look.done(0.1)  # node 1 (among the 3 nearest) is still fresh
    assert look.to_ask(0.21) == [] and look.done(0.21)  # late now: not waited for; 4 and 5 are not among the
    assert [n.long_id for n in look.nearest()] == [2, 3]  # 3 nearest; the answered ones, nearest first


def test_a_late_answer_before_the_end_is_used_and_a_failed_node_gives_way_to_the_next():
    look = Lookup(TARGET, [_node(n) for n in (1, 2, 8)], k=2, alpha=1, grace=0.2)
    assert [n.long_id for n in look.to_ask(0.0)] == [1]
    assert [n.long_id for n in look.to_ask(0.3)] == [2]  # 1 is late: room for the next
    look.answered(_node(1), [_node(3)])  # its late answer names a nearer-than-8 node
    look.failed(_node(2))
    assert [n.long_id for n in look.to_ask(0.31)] == [3]  # the 2 nearest not failed are 1 and 3
    assert not look.done(0.31)
    look.answered(_node(3), [])
    assert look.done(0.32) and [n.long_id for n in look.nearest()] == [1, 3]


def test_a_node_silent_to_another_question_is_not_waited_for_again():
    look = Lookup(TARGET, [_node(1), _node(2)], k=2, alpha=2, grace=0.2)
    first, second = look.to_ask(0.0)
    look.unwaited(first)
    look.answered(second, [])
    assert look.done(0.01) and [n.long_id for n in look.nearest()] == [2]


def test_the_grace_is_three_median_round_trips_within_its_bounds():
    rtt = Rtt(first_grace=1.0)
    assert rtt.grace(cap=0.5) == 0.5  # no sample yet: the first grace, capped
    for s in (0.01, 0.02, 0.03, 5.0):  # one outlier (a busy start) does not move a median
        rtt.sample(s)
    assert rtt.grace(cap=1.0) == GRACE_MIN  # 3 x the median, 25 ms, is below the least grace
    for _ in range(16):
        rtt.sample(0.2)
    assert rtt.grace(cap=1.0) == pytest.approx(0.6) and rtt.grace(cap=0.4) == 0.4


@pytest.fixture
def silent_member() -> Iterator[tuple[list[DhtNode], tuple[str, int]]]:
    """Two server nodes that know a third, which then went silent (its event loop stopped, as a SIGSTOPped
    process's: its socket takes datagrams and nothing answers): they keep naming it. RPC timeouts are 30 s."""
    a = DhtNode(server=True, rpc_timeout=30.0)
    addr = a.start("127.0.0.1", 0, [], 5.0)
    b = DhtNode(server=True, rpc_timeout=30.0)
    b.start("127.0.0.1", 0, [addr], 5.0)
    c = DhtNode(server=True, rpc_timeout=30.0)
    gone = c.start("127.0.0.1", 0, [addr], 5.0)
    c.loop.call_soon_threadsafe(c.loop.stop)
    try:
        assert gone in a.neighbours()
        yield [a, b], addr
    finally:
        c.stop()
        a.stop()
        b.stop()


def test_a_newcomer_joins_writes_and_reads_while_a_node_the_others_name_is_silent(silent_member):
    """Each step has 5 s, a sixth of the RPC timeout: the package's crawl waited that timeout for the silent
    node in every round, so the newcomer's start itself ran out (TimeoutError)."""
    _, addr = silent_member
    newcomer = DhtNode(server=True, rpc_timeout=30.0)
    try:
        newcomer.start("127.0.0.1", 0, [addr], 5.0)
        blob = KEYS.seal("quic/addr/1", b"10.0.0.1:4000", 1, time.time() + 60)
        assert newcomer.put(KEY, blob, 5.0) == 3  # a, b and the newcomer itself
        reader = DhtNode(server=False, rpc_timeout=30.0)
        try:
            reader.start("127.0.0.1", 0, [addr], 5.0)
            assert reader.fetch(KEY, 5.0) == [blob, blob, blob]
        finally:
            reader.stop()
    finally:
        newcomer.stop()
