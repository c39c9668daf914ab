"""An epoch's set-up keys kept among its members (``elastic.board``): five members over in-memory mailboxes
that lose messages. Values and counters reach every member, lost ones come back by asking, a counter is the
sum of every member's share whatever the order, and what a stranger or a forgotten epoch sends is dropped."""

from __future__ import annotations

import threading
import time

import pytest
from test_registers import MEMBERS, Mailboxes

from erdma_core.elastic import board
from erdma_core.elastic.board import Boards
from erdma_core.errors import CollectiveTimeoutError, ProtocolError


@pytest.fixture
def boards():
    made: list[dict[str, Boards]] = []

    def make(loss: float = 0.0, seed: int = 0, epochs: dict[int, list[str]] | None = None) -> dict[str, Boards]:
        net = Mailboxes(loss, seed)
        known = epochs or {3: MEMBERS}
        out = {m: Boards(m, net.of(m), known.get) for m in MEMBERS}
        made.append(out)
        return out

    yield make
    for out in made:
        for b in out.values():
            b.close()


@pytest.mark.parametrize("seed", range(3))
def test_values_and_counters_reach_every_member_over_a_lossy_mailbox(boards, seed):
    """Half the messages are lost: a member waiting for a value or a count asks again until it has it."""
    members = boards(loss=0.5, seed=seed)

    def rank(i: int, m: str) -> None:
        members[m].set(3, f"addr/{i}", f"host:{i}".encode())
        members[m].add(3, "set-up", 1)

    threads = [threading.Thread(target=rank, args=(i, m)) for i, m in enumerate(MEMBERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for m in MEMBERS:
        assert [members[m].get(3, f"addr/{i}", 30.0) for i in range(5)] == [f"host:{i}".encode() for i in range(5)]
    count = members["m0"].add(3, "set-up", 0)
    end = time.monotonic() + 60  # (rank 0's wait for every rank's share: each look asks the others again)
    while count != 5 and time.monotonic() < end:
        threading.Event().wait(0.05)
        count = members["m0"].add(3, "set-up", 0)
    assert count == 5


def test_a_counter_is_the_sum_of_each_members_latest_share_in_any_order(boards):
    members = boards()
    for _ in range(3):
        members["m1"].add(3, "c", 2)
    members["m2"].add(3, "c", 1)
    assert members["m1"].add(3, "c", 0) == 6
    end = time.monotonic() + 30
    while members["m4"].add(3, "c", 0) != 7 and time.monotonic() < end:
        threading.Event().wait(0.05)
    assert members["m4"].add(3, "c", 0) == 7  # 6 from m1 (its latest share), 1 from m2


def test_a_key_nobody_set_times_out_naming_it_and_forgotten_epochs_are_refused(boards):
    members = boards(epochs={3: MEMBERS, 4: MEMBERS})
    with pytest.raises(CollectiveTimeoutError, match=r"'addr/9' of epoch 3's set-up did not come within 0.5s"):
        members["m0"].get(3, "addr/9", 0.5)
    members["m0"].forget(4)
    with pytest.raises(ProtocolError, match="epoch 3's board cannot take"):
        members["m0"].set(3, "addr/0", b"x")
    members["m1"].set(3, "late", b"x")  # (m0 drops it: epoch 3 is forgotten there)
    members["m1"].set(4, "now", b"y")
    assert members["m0"].get(4, "now", 10.0) == b"y"
    with pytest.raises(CollectiveTimeoutError):
        members["m0"].get(3, "late", 0.5)


def test_malformed_and_oversized_messages_are_refused():
    with pytest.raises(ProtocolError, match="malformed"):
        board.decode(board.encode(9, 1, "k"))
    with pytest.raises(ProtocolError, match="malformed"):
        board.decode(board.encode(2, 1, "k", b"\x00"))  # a share is 8 bytes
    with pytest.raises(ProtocolError, match="a message of 3 bytes"):
        board.decode(b"abc")
    assert board.decode(board.encode(1, 7, "pg/7/erdma/job", b"v")) == (1, 7, "pg/7/erdma/job", b"v")


def test_a_board_holds_at_most_max_entries_keys(boards, monkeypatch):
    monkeypatch.setattr(board, "MAX_ENTRIES", 4)
    members = boards()
    for i in range(4):
        members["m0"].set(3, f"k{i}", b"v")
    with pytest.raises(ProtocolError, match="full"):
        members["m0"].set(3, "k4", b"v")
    members["m0"].set(3, "k0", b"again")  # a key it holds can change


def test_a_newcomer_whose_first_board_is_many_epochs_on_gets_what_was_set_before_it_asked(boards):
    """A newcomer admitted into epoch 9 holds no board yet: what a member sets for epoch 9 before the newcomer's
    own set-up looks is dropped there (more than AHEAD epochs past its newest board), and its own ``get``
    makes the board and asks (before, the ask went nowhere and its set-up waited out its timeout)."""
    members = boards(epochs={9: MEMBERS})
    for m in MEMBERS[1:]:
        members[m].set(9, "erdma/job", b"rank 0's")
    assert members["m0"].get(9, "erdma/job", 10.0) == b"rank 0's"
