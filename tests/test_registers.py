"""A member's registers on their own thread (``elastic.registers``), five members over in-memory mailboxes
that lose and can be cut: racing callers all get one value; a member cut off from the majority pauses with an
error that says so, and learns the value once joined again."""

from __future__ import annotations

import queue
import random
import threading
import time

import pytest

from erdma_core.elastic.registers import Registers
from erdma_core.errors import CollectiveTimeoutError

MEMBERS = [f"m{i}" for i in range(5)]


class Mailboxes:
    """In-memory mailboxes between members: each message is lost with probability ``loss``, and never crosses
    ``cut`` (pairs of members)."""

    def __init__(self, loss: float = 0.0, seed: int = 0) -> None:
        self.loss, self.rng = loss, random.Random(seed)
        self.inboxes: dict[str, queue.Queue[tuple[str, bytes]]] = {m: queue.Queue() for m in MEMBERS}
        self.cut: set[frozenset[str]] = set()
        self.lock = threading.Lock()

    def of(self, me: str) -> Mailbox:
        return Mailbox(self, me)


class Mailbox:
    def __init__(self, net: Mailboxes, me: str) -> None:
        self.net, self.me = net, me

    def send(self, to: str, data: bytes) -> None:
        with self.net.lock:
            lost = self.net.rng.random() < self.net.loss or frozenset((self.me, to)) in self.net.cut
        if not lost:
            self.net.inboxes[to].put((self.me, data))

    def recv(self, timeout: float) -> tuple[str, bytes] | None:
        try:
            return self.net.inboxes[self.me].get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        pass


@pytest.fixture
def members():
    made: list[tuple[Mailboxes, dict[str, Registers]]] = []

    def make(loss: float = 0.0) -> tuple[Mailboxes, dict[str, Registers]]:
        net = Mailboxes(loss)
        regs = {m: Registers(m, net.of(m), retry_s=0.1, rng=random.Random(i)) for i, m in enumerate(MEMBERS)}
        made.append((net, regs))
        return net, regs

    yield make
    for _, regs in made:
        for r in regs.values():
            r.close()


def test_racing_members_over_lossy_mailboxes_all_get_one_value(members):
    _, regs = members(loss=0.15)
    got: dict[str, bytes] = {}

    def decide(m: str) -> None:
        got[m] = regs[m].decide("epoch/2", f"from {m}".encode(), MEMBERS, 30.0)

    threads = [threading.Thread(target=decide, args=(m,)) for m in MEMBERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 5 and len(set(got.values())) == 1, got
    assert regs["m0"].read("epoch/2", MEMBERS, 30.0) == next(iter(got.values()))


def test_a_member_cut_off_from_the_majority_pauses_saying_so_and_learns_the_value_once_joined(members):
    net, regs = members()
    assert regs["m4"].read("epoch/3", MEMBERS, 10.0) is None  # nothing decided yet
    net.cut = {frozenset((a, b)) for a in ("m0", "m1") for b in MEMBERS[2:]}
    assert regs["m3"].decide("epoch/3", b"majority", MEMBERS, 10.0) == b"majority"
    with pytest.raises(CollectiveTimeoutError, match=r"'epoch/3' was not decided within 1.0s: 3 of its 5 acceptors "
                                                     r"\(m0, m1, m2, m3, m4\) must answer and [12] did \(m0(, m1)?\); "
                                                     r"this member is cut off from a majority"):
        regs["m0"].decide("epoch/3", b"minority", MEMBERS, 1.0)
    net.cut.clear()
    assert regs["m0"].decide("epoch/3", b"minority", MEMBERS, 10.0) == b"majority"
    assert regs["m1"].read("epoch/3", MEMBERS, 10.0) == b"majority"


def test_two_of_five_gone_leave_a_majority_and_three_gone_none(members):
    net, regs = members()
    gone = {"m0", "m1"}
    net.cut = {frozenset((a, b)) for a in gone for b in MEMBERS if b != a}
    assert regs["m4"].decide("k", b"v", MEMBERS, 10.0) == b"v"
    net.cut |= {frozenset(("m2", b)) for b in MEMBERS if b != "m2"}
    with pytest.raises(CollectiveTimeoutError, match=r"must answer and [12] did \((m3, )?m4\)"):
        regs["m4"].decide("k2", b"v", MEMBERS, 1.0)


def test_members_learn_a_decision_as_it_is_made_and_answer_from_it_with_no_round(members):
    net, regs = members()
    assert regs["m2"].decide("vote/1/0/2", b"done", MEMBERS, 10.0) == b"done"
    deadline = time.monotonic() + 10
    while any(regs[m].learned("vote/1/0/2") is None for m in MEMBERS) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert {m: regs[m].learned("vote/1/0/2") for m in MEMBERS} == dict.fromkeys(MEMBERS, b"done")
    net.cut = {frozenset(("m0", b)) for b in MEMBERS if b != "m0"}  # m0 alone: a round could not end
    assert regs["m0"].decide("vote/1/0/2", b"dead", MEMBERS, 1.0) == b"done"
    regs["m0"].forget("vote/1/")
    assert regs["m0"].learned("vote/1/0/2") is None


def test_each_epoch_is_decided_by_the_one_before_so_a_minority_never_forms_one_and_a_late_member_learns_it(members):
    from erdma_core.elastic import quorums
    from erdma_core.elastic.membership import Member, Record

    net, regs = members()
    records: dict[int, Record] = {}

    def record(epoch: int, ids: tuple[str, ...]) -> bytes:
        return Record(epoch, tuple(Member(m, m, True) for m in ids), 0).encode()

    def propose(by: str, epoch: int, ids: tuple[str, ...], timeout: float = 10.0) -> Record:
        key = f"epoch/{epoch}"
        who = quorums.acceptors(key, records.get)
        assert who is not None
        got = Record.decode(regs[by].decide(key, record(epoch, ids), who, timeout))
        records[epoch] = got
        return got

    assert quorums.acceptors("epoch/1", records.get) is None  # the creator's: nobody decides it
    records[1] = Record.decode(record(1, ("m0", "m1", "m2")))
    assert quorums.acceptors("vote/1/0/outcome", records.get) == ("m0", "m1", "m2")
    assert quorums.acceptors("epoch/3", records.get) is None  # epoch 2 not known here yet
    assert propose("m1", 2, ("m0", "m1", "m2", "m3")).members[3].id == "m3"
    net.cut = {frozenset(("m0", b)) for b in MEMBERS if b != "m0"}
    with pytest.raises(CollectiveTimeoutError, match=r"'epoch/3' was not decided within 1.0s: 3 of its 4 acceptors"):
        propose("m0", 3, ("m0",), timeout=1.0)  # 1 of epoch 2's 4 members: it pauses
    assert [m.id for m in propose("m2", 3, ("m1", "m2", "m3", "m4")).members] == ["m1", "m2", "m3", "m4"]
    net.cut.clear()
    assert [m.id for m in propose("m0", 3, ("m0", "m1")).members] == ["m1", "m2", "m3", "m4"]  # learns the majority's
    net.cut = {frozenset((a, b)) for a in ("m1", "m2") for b in ("m3", "m4")}  # epoch 3 split in halves
    for by, ids in (("m1", ("m1", "m2")), ("m3", ("m3", "m4"))):
        with pytest.raises(CollectiveTimeoutError, match="'epoch/4' was not decided"):
            propose(by, 4, ids, timeout=1.0)
    net.cut.clear()
    assert propose("m4", 4, ("m3", "m4")).epoch == 4


def test_a_member_behind_the_others_is_told_its_key_is_retired_and_decides_nothing():
    from erdma_core.elastic.registers import RetiredError

    net = Mailboxes()
    retired: set[str] = set()
    regs = {m: Registers(m, net.of(m), retry_s=0.1, rng=random.Random(i),
                         retired=lambda key: any(key.startswith(p) for p in retired)) for i, m in enumerate(MEMBERS)}
    try:
        assert regs["m0"].decide("vote/2/5/1", b"dead", MEMBERS, 10.0) == b"dead"
        retired.add("vote/2/")
        for r in regs.values():
            r.forget("vote/2/")
        with pytest.raises(RetiredError, match="'vote/2/5/1' belongs to a step or epoch the members are done with"):
            regs["m1"].decide("vote/2/5/1", b"done", MEMBERS, 10.0)
        with pytest.raises(RetiredError):
            regs["m1"].read("vote/2/5/outcome", MEMBERS, 10.0)
    finally:
        for r in regs.values():
            r.close()


def test_a_decision_after_a_read_of_the_same_key_decides(members):
    _, regs = members()
    assert regs["m0"].read("vote/4/0/outcome", MEMBERS, 10.0) is None
    assert regs["m0"].decide("vote/4/0/outcome", b"commit", MEMBERS, 10.0) == b"commit"
    assert regs["m0"].read("vote/4/0/outcome", MEMBERS, 10.0) == b"commit"
