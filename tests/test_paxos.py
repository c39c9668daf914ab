"""The serverless membership's registers (``elastic.paxos``), run in simulated time over a network that loses,
duplicates, delays and reorders messages and can be cut in two: whatever happens, no two outcomes of one key
differ; with a majority of acceptors reachable every proposal ends; without one, none does."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from erdma_core.elastic import paxos
from erdma_core.errors import ProtocolError

MEMBERS = [f"m{i}" for i in range(5)]


class Net:
    """A ``paxos.Node`` per member (made when first used), moved by one event queue in simulated time;
    ``MEMBERS`` are the acceptors unless a proposal names others."""

    def __init__(self, seed: int, *, loss: float = 0.0, dup: float = 0.0,
                 latency: tuple[float, float] = (0.001, 0.05)) -> None:
        self.rng = random.Random(seed)
        self.loss, self.dup, self.latency = loss, dup, latency
        self.nodes: dict[str, paxos.Node] = {}
        self.cut: set[frozenset[str]] = set()  # pairs that cannot reach each other
        self.down: set[str] = set()  # crashed members: nothing in, nothing out
        self.now = 0.0
        self._queue: list[tuple[float, int, str, str, bytes]] = []
        self._order = itertools.count()

    def node(self, me: str) -> paxos.Node:
        if me not in self.nodes:
            self.nodes[me] = paxos.Node(me, retry_s=0.2, rng=random.Random(self.rng.random()))
        return self.nodes[me]

    def send(self, sender: str, out: list[tuple[str, bytes]]) -> None:
        for to, data in out:
            for _ in range(2 if self.rng.random() < self.dup else 1):
                if self.rng.random() >= self.loss:
                    heapq.heappush(self._queue, (self.now + self.rng.uniform(*self.latency), next(self._order),
                                                 sender, to, data))

    def propose(self, me: str, key: str, value: bytes | None, acceptors=MEMBERS) -> paxos.Proposal:
        for a in acceptors:
            self.node(a)
        self.send(me, self.node(me).propose(key, value, acceptors, self.now))
        p = self.nodes[me].proposal(key)
        assert p is not None
        return p

    def run(self, until: float) -> None:
        while True:
            polls = [d for me, n in self.nodes.items() if me not in self.down and (d := n.deadline()) is not None]
            at = min([*polls, self._queue[0][0]] if self._queue else polls, default=None)
            if at is None or at > until:
                self.now = until
                return
            self.now = at
            if self._queue and self._queue[0][0] <= at:
                _, _, sender, to, data = heapq.heappop(self._queue)
                if to in self.down or sender in self.down or frozenset((sender, to)) in self.cut:
                    continue
                self.send(to, self.node(to).receive(sender, data, self.now))
            for me, n in self.nodes.items():
                if me not in self.down:
                    self.send(me, n.poll(self.now))

    def split(self, side: set[str]) -> None:
        self.cut = {frozenset((a, b)) for a in side for b in MEMBERS if b not in side}


@pytest.mark.parametrize("seed", range(150))
def test_racing_proposers_over_a_lossy_network_all_decide_one_value(seed):
    net = Net(seed, loss=0.2, dup=0.1)
    props = [net.propose(f"m{i}", "epoch/7", f"record of m{i}".encode()) for i in net.rng.sample(range(5), 3)]
    net.run(60.0)
    outcomes = {p.outcome for p in props}
    assert None not in outcomes, [p.rounds for p in props]
    assert len(outcomes) == 1 and outcomes.pop() in {p.value for p in props}, outcomes
    read = net.propose("reader", "epoch/7", None)  # (a member that is no acceptor of this key)
    net.run(120.0)
    assert read.outcome == props[0].outcome


@pytest.mark.parametrize("seed", range(20))
def test_racing_proposers_whose_answers_come_slower_than_retry_s_still_decide(seed):
    """Every message takes 0.3-0.5 s, more than ``retry_s`` (0.2 s): a loaded machine. A round waits longer
    each time, so a later one hears its majority (with a fixed 0.2 s wait, every round started anew before
    its answers came, and two racing members never decided)."""
    net = Net(seed, latency=(0.3, 0.5))
    props = [net.propose(m, "epoch/2", m.encode()) for m in ("m1", "m2")]
    net.down = {"m0", "m3"}  # (two of five gone: a majority is every one of the other three)
    net.run(60.0)
    outcomes = {p.outcome for p in props}
    assert len(outcomes) == 1 and outcomes.pop() in {b"m1", b"m2"}, [p.rounds for p in props]


def test_a_proposer_cut_off_with_a_minority_never_decides_and_learns_the_majoritys_value_once_joined():
    net = Net(1)
    net.split({"m0", "m1"})
    minority = net.propose("m0", "epoch/3", b"minority")
    majority = net.propose("m4", "epoch/3", b"majority")
    net.run(30.0)
    assert minority.outcome is None and majority.outcome == b"majority"
    assert minority.rounds > 10  # it kept trying
    net.cut.clear()
    net.run(60.0)
    assert minority.outcome == b"majority"


def test_an_even_split_decides_nothing_on_either_side():
    net = Net(2)
    net.cut = {frozenset((a, b)) for a in ("m0", "m1") for b in ("m2", "m3")}
    sides = [net.propose("m0", "k", b"left", MEMBERS[:4]), net.propose("m3", "k", b"right", MEMBERS[:4])]
    net.run(30.0)
    assert [p.outcome for p in sides] == [None, None]


@pytest.mark.parametrize("crashed, decides", [(0, True), (1, True), (2, True), (3, False)])
def test_a_majority_of_live_acceptors_is_enough_and_needed(crashed, decides):
    net = Net(3)
    net.down = set(MEMBERS[:crashed])
    p = net.propose("m4", "k", b"v")
    net.run(30.0)
    assert (p.outcome == b"v") is decides, p.outcome


def test_a_proposer_that_crashes_mid_accept_leaves_a_value_the_next_one_finishes_or_replaces_never_splits():
    for seed in range(60):
        net = Net(seed)
        first = net.propose("m0", "k", b"first")
        net.run(net.rng.uniform(0.0, 0.12))  # somewhere in its two phases
        net.down.add("m0")
        second = net.propose("m1", "k", b"second")
        net.run(30.0)
        assert second.outcome in (b"first", b"second")
        if first.outcome is not None:  # it had decided before it crashed: the next one learns that value
            assert second.outcome == first.outcome, seed


@pytest.mark.parametrize("seed", range(40))
def test_members_learn_the_decided_value_without_a_read_and_never_another(seed):
    net = Net(seed, loss=0.2 if seed % 2 else 0.0, dup=0.1)
    proposals = [net.propose(m, "epoch/3", m.encode()) for m in MEMBERS[:3]]
    net.run(60.0)
    outcomes = {p.outcome for p in proposals}
    assert len(outcomes) == 1 and isinstance(next(iter(outcomes)), bytes), (seed, outcomes)
    learned = {m: net.nodes[m].learned("epoch/3") for m in MEMBERS}
    assert set(learned.values()) - {None} == outcomes, (seed, learned)
    if not net.loss:
        assert all(v is not None for v in learned.values()), (seed, learned)  # every acceptor was told
    for m in MEMBERS:
        net.nodes[m].forget("epoch/")
        assert net.nodes[m].learned("epoch/3") is None


@pytest.mark.parametrize("retire", [False, True])
def test_a_forgotten_key_is_decided_anew_unless_retired_first_and_then_its_proposals_end_stale(retire):
    retired: set[str] = set()
    net = Net(7)
    for i, m in enumerate(MEMBERS):
        net.nodes[m] = paxos.Node(m, retry_s=0.2, rng=random.Random(i),
                                  retired=lambda key: any(key.startswith(p) for p in retired))
    first = net.propose("m0", "vote/1/0/3", b"dead")
    net.run(5.0)
    assert first.outcome == b"dead"
    if retire:
        retired.add("vote/1/")
    for n in net.nodes.values():
        n.forget("vote/1/")
    zombie = net.propose("m3", "vote/1/0/3", b"done")  # the member voted dead, come back late
    net.run(10.0)
    if retire:  # refused by every acceptor, which keeps nothing for it
        assert zombie.outcome is paxos.STALE and repr(zombie.outcome) == "STALE"
        assert all(n.acceptor.keys() == 0 for n in net.nodes.values())
    else:  # what retiring is for: forgotten alone, the key took the late member's other value
        assert zombie.outcome == b"done"


def test_a_read_finds_nothing_before_a_decision_and_the_value_after():
    net = Net(4)
    before = net.propose("r1", "k", None)
    net.run(5.0)
    assert before.outcome is paxos.EMPTY
    net.propose("m0", "k", b"v")
    net.run(10.0)
    after = net.propose("r2", "k", None)
    net.run(15.0)
    assert after.outcome == b"v"


def test_a_value_accepted_by_one_acceptor_is_read_as_nothing_or_as_itself_and_a_value_read_stays():
    seen = set()
    for seed in range(30):
        net = Net(seed)
        net.node("m0").acceptor.handle(paxos.Prepare("k", paxos.Ballot(1, "a")))
        net.node("m0").acceptor.handle(paxos.Accept("k", paxos.Ballot(1, "a"), b"lone"))
        read = net.propose("r1", "k", None)
        net.run(10.0)
        seen.add(read.outcome)
        later = net.propose("r2", "k", b"later")
        net.run(20.0)
        if read.outcome is paxos.EMPTY:  # nothing was decided: either may be (the later one's majority may
            assert later.outcome in (b"later", b"lone"), seed  # include m0, which must then propose its value)
        else:
            assert later.outcome == b"lone", (seed, read.outcome)
    assert paxos.EMPTY in seen and b"lone" in seen  # both happen: whether the read's majority included m0


def test_answers_from_strangers_and_repeats_from_one_acceptor_never_make_a_majority():
    p = paxos.Proposal("k", b"v", "m0", MEMBERS, retry_s=1.0, rng=random.Random(0))
    p.start(0.0)
    for sybil in (f"x{i}" for i in range(20)):
        p.receive(sybil, paxos.Promise("k", p.ballot, paxos.NONE, None), 0.1)
    for _ in range(5):
        p.receive("m1", paxos.Promise("k", p.ballot, paxos.NONE, None), 0.1)
    p.receive("m2", paxos.Promise("other", p.ballot, paxos.NONE, None), 0.1)
    p.receive("m3", paxos.Promise("k", paxos.Ballot(p.ballot.round + 1, "m0"), paxos.NONE, None), 0.1)
    assert p.outcome is None
    assert p.receive("m2", paxos.Promise("k", p.ballot, paxos.NONE, None), 0.1) == []
    out = p.receive("m4", paxos.Promise("k", p.ballot, paxos.NONE, None), 0.1)  # m1, m2, m4: a majority
    assert {to for to, _ in out} == set(MEMBERS) and all(m == paxos.Accept("k", p.ballot, b"v") for _, m in out)


def test_an_acceptor_refuses_a_lower_ballot_and_answers_a_repeated_prepare_alike():
    a = paxos.Acceptor()
    low, high = paxos.Ballot(1, "m1"), paxos.Ballot(2, "m0")
    assert a.handle(paxos.Prepare("k", high)) == paxos.Promise("k", high, paxos.NONE, None)
    assert a.handle(paxos.Prepare("k", high)) == paxos.Promise("k", high, paxos.NONE, None)
    assert a.handle(paxos.Prepare("k", low)) == paxos.Refused("k", low, high)
    assert a.handle(paxos.Accept("k", low, b"x")) == paxos.Refused("k", low, high)
    assert a.handle(paxos.Accept("k", high, b"y")) == paxos.Accepted("k", high)
    assert a.handle(paxos.Prepare("k", paxos.Ballot(3, "m2"))) == paxos.Promise("k", paxos.Ballot(3, "m2"), high,
                                                                                 b"y")


def test_an_acceptor_holds_a_bounded_number_of_keys_and_forgets_an_epochs():
    a = paxos.Acceptor()
    b = paxos.Ballot(1, "m0")
    for i in range(paxos.MAX_KEYS):
        a.handle(paxos.Prepare(f"vote/1/{i}", b))
    with pytest.raises(ProtocolError, match=r"holds 4096 keys already; 'vote/2/0' refused"):
        a.handle(paxos.Prepare("vote/2/0", b))
    a.handle(paxos.Prepare("vote/1/0", paxos.Ballot(2, "m0")))  # a key it holds still answers
    a.forget("vote/1/")
    assert a.keys() == 0
    assert isinstance(a.handle(paxos.Prepare("vote/2/0", b)), paxos.Promise)


MESSAGES = [
    paxos.Prepare("epoch/2", paxos.Ballot(3, "m1")),
    paxos.Promise("epoch/2", paxos.Ballot(3, "m1"), paxos.NONE, None),
    paxos.Promise("epoch/2", paxos.Ballot(3, "m1"), paxos.Ballot(2, "m0"), b"\x00rec"),
    paxos.Promise("k", paxos.Ballot(1, "m"), paxos.Ballot(1, "m"), b""),
    paxos.Accept("epoch/2", paxos.Ballot(2**64 - 1, "\u00e9"), b"x" * 1000),
    paxos.Accepted("vote/1/3", paxos.Ballot(9, "m2")),
    paxos.Refused("vote/1/3", paxos.Ballot(9, "m2"), paxos.Ballot(10, "m3")),
    paxos.Chosen("vote/1/outcome", paxos.Ballot(4, "m1"), b"commit:0:0:0"),
]


@pytest.mark.parametrize("msg", MESSAGES)
def test_every_message_crosses_the_wire_unchanged_and_any_cut_of_it_is_refused(msg):
    raw = paxos.encode(msg)
    assert paxos.decode(raw) == msg
    for end in range(len(raw)):
        with pytest.raises(ProtocolError):
            paxos.decode(raw[:end])
    with pytest.raises(ProtocolError, match="1 bytes after a message"):
        paxos.decode(raw + b"\0")


@pytest.mark.parametrize("raw, said", [
    (b"\x09\x00\x01k" + bytes(9), "message kind 9; valid: 1-6"),
    (b"\x01\x01\x01" + b"k" * 257 + bytes(9), "a key of 257 bytes; at most 256"),
    (b"\x01\x00\x01\xff" + bytes(9), "a key that is not UTF-8"),
    (b"\x03\x00\x01k" + bytes(9) + b"\x00\x10\x00\x01", "a value of 1048577 bytes; at most 1048576"),
    (b"\x02\x00\x01k" + bytes(9) + bytes(9) + b"\x02", "a Promise's value flag is 2; valid: 0 or 1"),
])
def test_malformed_messages_are_refused_saying_what_is_wrong(raw, said):
    with pytest.raises(ProtocolError, match=said):
        paxos.decode(raw)


def test_random_bytes_decode_to_a_message_or_a_protocol_error_never_anything_else():
    rng = random.Random(5)
    for _ in range(20000):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        if rng.random() < 0.5:
            raw = bytes([rng.randrange(1, 6)]) + raw
        try:
            msg = paxos.decode(raw)
        except ProtocolError:
            continue
        assert paxos.encode(msg) == raw


def test_a_node_drops_bytes_that_are_no_message_and_a_full_acceptor_answers_nothing():
    node = paxos.Node("m0", retry_s=0.2, rng=random.Random(0))
    with pytest.raises(ProtocolError):
        node.receive("m1", b"\x07garbage", 0.0)
    for i in range(paxos.MAX_KEYS):
        node.acceptor.handle(paxos.Prepare(f"old/{i}", paxos.Ballot(1, "m1")))
    assert node.receive("m1", paxos.encode(paxos.Prepare("new", paxos.Ballot(1, "m1"))), 0.0) == []
    assert node.receive("m1", paxos.encode(paxos.Prepare("old/3", paxos.Ballot(2, "m1"))), 0.0) == [
        ("m1", paxos.encode(paxos.Promise("old/3", paxos.Ballot(2, "m1"), paxos.NONE, None)))]
    node.forget("old/")
    assert node.acceptor.keys() == 0


def test_a_nodes_own_acceptor_answers_at_once_and_forget_drops_an_epochs_proposals():
    net = Net(7)
    p = net.propose("m0", "vote/3/0", b"done")
    assert len(p._promises) == 1  # its own promise, before anything crossed the network
    net.run(5.0)
    assert net.node("m0").outcome("vote/3/0") == b"done" and net.node("m0").deadline() is None
    assert net.propose("m0", "vote/3/0", b"other") is p  # one proposal per key: the first goes on
    net.node("m0").forget("vote/3/")
    assert net.node("m0").outcome("vote/3/0") is None and net.node("m0").acceptor.keys() == 0
