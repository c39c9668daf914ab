"""``elastic.peer_store`` without a DHT: three members' stores over their real mesh on loopback and an
in-memory bulletin, driven through the calls an elastic group makes. Decisions agree, the vote counter
counts learned votes, and over many epochs what a member holds stays bounded: old records, the keys of
finished steps and the links to members that left are given back."""

from __future__ import annotations

import json
import threading
import time

import pytest

from erdma_core.elastic import admission, peer_store
from erdma_core.elastic.membership import DONE, Keys, Member, Record
from erdma_core.errors import CollectiveTimeoutError


class Bulletin:
    """set/get/add in memory (a DHT's calls, without the DHT)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key: str, timeout: float) -> bytes:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout):
                raise CollectiveTimeoutError(f"{key!r} not there")
            return self.data[key]

    def add(self, key: str, amount: int) -> int:
        with self.cond:
            n = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(n).encode()
            return n

    def close(self) -> None:
        pass


def test_members_decide_through_many_epochs_and_give_back_what_they_are_done_with():
    bulletin = Bulletin()
    stores = [peer_store.PeerStore(bulletin, b"s" * 32, "job", host="127.0.0.1", advertise="127.0.0.1")
              for _ in range(4)]
    keys = Keys("job")
    ids = [s.member_id for s in stores]
    try:
        first = Record(1, tuple(Member(i, i, True) for i in ids[:3]), 3)
        bulletin.set(keys("epoch", 1), first.encode())
        assert Record.decode(stores[0].get(keys("epoch", 1), 1.0)) == first
        members = ids[:3]
        for epoch in range(1, 16):
            record = Record.decode(stores[0].get(keys("epoch", epoch), 10.0))
            assert [m.id for m in record.members] == members
            live = [s for s in stores if s.member_id in members]
            for step in range(3):
                for index, s in enumerate(live):
                    assert s.compare_set(keys("vote", epoch, step, index), b"", DONE) == DONE
                for s in live:
                    deadline = time.monotonic() + 10
                    while s.add(keys("vote", epoch, step, "count"), 1) < len(live):  # (learned votes)
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                outcome = {s.compare_set(keys("vote", epoch, step, "outcome"), b"", b"commit:0:0:0") for s in live}
                assert outcome == {b"commit:0:0:0"}
            members = ids[:4] if epoch == 2 else ids[:3] if epoch == 5 else members  # m3 comes, goes
            nxt = Record(epoch + 1, tuple(Member(i, i, True) for i in members), 3)
            got = {s.compare_set(keys("epoch", epoch + 1), b"", nxt.encode()) for s in live}
            assert got == {nxt.encode()}
        held = stores[0]
        assert len(held._records) <= peer_store.KEEP_EPOCHS + 2, sorted(held._records)
        assert held._regs._node.acceptor.keys() < 40  # the last steps' keys, not 15 epochs' worth
        assert ids[3] not in held._where_cache and ids[3] not in held.mesh._links  # left at epoch 6
        assert bulletin.data[keys("epoch", 16)] == nxt.encode()  # decided records are put on the bulletin
        assert bulletin.data[keys("epoch", "latest")] == b"16"  # by its member 0, as the latest
        for gone in (3, 4, 5, 9, 12, 14):  # what a DHT lost: a search that doubles and halves would stop at 2
            del bulletin.data[keys("epoch", gone)]
        assert admission.latest(bulletin, keys) == nxt
        bulletin.data[keys("epoch", "latest")] = b"15"  # a hint behind: the next is read on
        assert admission.latest(bulletin, keys) == nxt
    finally:
        for s in stores:
            s.close()


def test_the_creator_founds_the_job_only_once_min_peers_tickets_have_names(monkeypatch):
    """A ticket is counted before its peer's name is on the bulletin (two writes, the second maybe slow on a
    DHT): the first record waits for the names and holds ``min_peers`` members, each once (before, a name
    not there within 5 s was skipped and epoch 1 had fewer members than the job's minimum)."""
    from erdma_core.elastic import founding
    from erdma_core.elastic.founding import found

    monkeypatch.setattr(founding, "SETTLE_S", 60.0)  # (a name late by more is a race's: the next test)
    bulletin = Bulletin()
    keys = Keys("default")
    made: list[Record] = []
    maker = threading.Thread(target=lambda: made.append(found(bulletin, "default", 3, 60.0)))
    maker.start()
    for t in (1, 2, 3):
        assert bulletin.add(keys("tickets"), 1) == t
    bulletin.set(keys("ticket", 1), b"p1 host:1")
    bulletin.set(keys("ticket", 2), b"p2 host:2")
    time.sleep(2.0)  # the third name comes late
    assert not made
    bulletin.set(keys("ticket", 3), b"p1 host:1")  # a peer named twice (it drew again) counts once
    bulletin.add(keys("tickets"), 1)
    bulletin.set(keys("ticket", 4), b"p3 host:3")
    maker.join(30)
    assert made and [(m.id, m.has_state) for m in made[0].members] == [("p1", True), ("p2", False), ("p3", False)]
    assert Record.decode(bulletin.get(keys("epoch", 1), 0.0)) == made[0]
    assert all(bulletin.get(keys("admit", t), 0.0) == b"1" for t in range(1, made[0].admitted + 1))


def test_the_creator_founds_with_the_peers_named_when_a_racing_draw_left_a_ticket_nameless():
    """Two peers drew ticket 2 at once (a DHT counter, each peer's share counted): 3 tickets counted, the third
    never named. After ``SETTLE_S`` the job is founded with the two named, every ticket admitted (the peer
    whose name lost draws again and is admitted by the members)."""
    from erdma_core.elastic import founding

    bulletin = Bulletin()
    keys = Keys("default")
    made: list[Record] = []
    maker = threading.Thread(target=lambda: made.append(founding.found(bulletin, "default", 3, 60.0)))
    maker.start()
    bulletin.add(keys("tickets"), 3)
    bulletin.set(keys("ticket", 1), b"p1 host:1")
    bulletin.set(keys("ticket", 2), b"p2 host:2")
    maker.join(founding.SETTLE_S + 20)
    assert made and [m.id for m in made[0].members] == ["p1", "p2"] and made[0].admitted == 3
    assert bulletin.get(keys("admit", 3), 0.0) == b"1"


def test_a_look_at_an_undecided_key_sends_nothing_and_a_wait_reads_only_after_read_s(monkeypatch):
    """Members' set-ups look at the epoch's first outcome every 0.25 s, all at once: each look that read (a
    Paxos round with a higher ballot, waited for up to DECIDE_S) dueled with the others and with the
    proposal looked for, and stalled each set-up for seconds. A look only sees what this member learned; a
    wait reads once it has waited READ_S, since a decision's Chosen comes first."""
    monkeypatch.setattr(peer_store, "READ_S", 30.0)  # (a wait of 0.3 s stays short of it on a busy machine)
    bulletin = Bulletin()
    stores = [peer_store.PeerStore(bulletin, b"s" * 32, "job", host="127.0.0.1", advertise="127.0.0.1")
              for _ in range(3)]
    keys = Keys("job")
    try:
        bulletin.set(keys("epoch", 1), Record(1, tuple(Member(s.member_id, "m", True) for s in stores), 3).encode())
        for s in stores:
            s.get(keys("epoch", 1), 1.0)
        sent: list[tuple[str, bytes]] = []
        real = stores[0]._regs._send
        stores[0]._regs._send = lambda out: (sent.extend(out), real(out))  # type: ignore[method-assign]
        outcome = keys("vote", 1, 0, "outcome")
        for wait in (0.0, 0.0, 0.3):
            try:
                stores[0].get(outcome, wait)
                raise AssertionError("nothing was decided")
            except CollectiveTimeoutError:
                pass
        assert sent == []
        assert stores[1].compare_set(outcome, b"", b"abort") == b"abort"
        assert stores[0].get(outcome, 5.0) == b"abort"  # learned from the Chosen: it answered, never asked
        assert [data[0] for _, data in sent] and not [data for _, data in sent if data[0] == 1]  # (1: Prepare)
    finally:
        for s in stores:
            s.close()


def test_a_newcomers_path_check_is_kept_among_it_and_the_members_it_asked_not_on_the_bulletin():
    """The request (``probe/<n>``) is on the bulletin and names who takes part; the pairs' keys go over the
    mesh among them (on the DHT, rank 0 of a pair waited out 5 s for a counter share a racing write lost)."""
    bulletin = Bulletin()
    member, newcomer, other = (peer_store.PeerStore(bulletin, b"s" * 32, "job", host="127.0.0.1",
                                                    advertise="127.0.0.1") for _ in range(3))
    keys = Keys("job")
    try:
        newcomer.set(keys("probe", 1), json.dumps({"id": newcomer.member_id, "name": "n:1",
                                                   "members": [member.member_id]}).encode())
        member.get(keys("probe", 1), 1.0)  # (as admission.answer reads it)
        member.set(keys("probe", 1, member.member_id, "start"), b"1")
        assert newcomer.get(keys("probe", 1, member.member_id, "start"), 10.0) == b"1"
        pair = keys("probe", 1, member.member_id) + "/erdma/set-up/1"
        assert member.add(pair, 1) == 1 and newcomer.add(pair, 1) >= 1
        deadline = time.monotonic() + 10
        while member.add(pair, 0) < 2 or newcomer.add(pair, 0) < 2:
            assert time.monotonic() < deadline, "the pair's shares did not meet"
            time.sleep(0.05)
        assert [k for k in bulletin.data if "/probe/1/" in k] == []
        with pytest.raises(CollectiveTimeoutError, match="of path check 1's set-up did not come"):
            other.get(keys("probe", 1, member.member_id, "start"), 0.5)  # not asked: told nothing
    finally:
        for s in (member, newcomer, other):
            s.close()


def test_a_member_that_is_no_longer_member_0_stops_keeping_the_latest_epoch_hint():
    """Member 0 of the newest record writes ``epoch/latest`` and keeps it written (a DHT loses keys); once a
    newer record has another member 0, it stops keeping it, else its stale number could outlast the new one's.
    An older record learned late changes nothing."""
    class Keeping(Bulletin):
        def __init__(self) -> None:
            super().__init__()
            self.kept: set[str] = set()

        def keep(self, key: str) -> None:
            self.kept.add(key)

        def unkeep(self, key: str) -> None:
            self.kept.discard(key)

    bulletin = Keeping()
    store = peer_store.PeerStore(bulletin, b"s" * 32, "job", host="127.0.0.1", advertise="127.0.0.1")
    keys, latest = Keys("job"), Keys("job")("epoch", "latest")
    me, other = store.member_id, "peer-b"
    try:
        def learn(epoch: int, members: list[str]) -> None:
            record = Record(epoch, tuple(Member(m, m, True) for m in members), 1)
            store._learned(keys("epoch", epoch), "epoch", record.encode())

        learn(3, [me, other])
        assert bulletin.data[latest] == b"3" and latest in bulletin.kept
        learn(4, [other, me])  # the other is member 0 now
        assert latest not in bulletin.kept and bulletin.data[latest] == b"3"  # (the new member 0 writes it)
        learn(2, [me, other])  # an older record, learned late: not a reason to write or keep the hint again
        assert latest not in bulletin.kept and bulletin.data[latest] == b"3"
        learn(5, [me])  # member 0 again
        assert bulletin.data[latest] == b"5" and latest in bulletin.kept
    finally:
        store.close()
