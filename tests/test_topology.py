"""Slow links and the ring a ring allreduce runs through: the identity unless it has slow neighbours, then
the ring with fewest, the same on every rank; and the ranks' agreement on the links through the store."""

from __future__ import annotations

import numpy as np
import pytest

from erdma_core.discovery.store import FileStore
from erdma_core.engine import topology


def links(*pairs: tuple[int, int]) -> topology.Links:
    return frozenset(frozenset(p) for p in pairs)


def test_no_slow_link_on_the_ring_keeps_the_group_order():
    assert topology.ring_order(6, frozenset()) == tuple(range(6))
    assert topology.ring_order(6, links((0, 3), (1, 4))) == tuple(range(6))  # not neighbours in 0..5


@pytest.mark.parametrize("size", [4, 5, 8])
def test_a_slow_pair_of_neighbours_is_moved_apart(size):
    order = topology.ring_order(size, links((1, 2)))
    assert sorted(order) == list(range(size)) and order[0] == 0
    assert topology.slow_edges(order, links((1, 2))) == 0


def test_the_fewest_slow_neighbours_when_none_avoids_them_all():
    # rank 1 reaches only rank 0 the fast way: every ring has at least one slow link at rank 1
    slow = links((1, 2), (1, 3))
    order = topology.ring_order(4, slow)
    assert topology.slow_edges(order, slow) == 1 and topology.slow_edges(tuple(range(4)), slow) == 1
    assert order == (0, 1, 2, 3)  # nothing beats the group's own order: it is kept


def test_large_groups_use_the_greedy_ring_and_beat_the_identity():
    size = 16
    slow = links(*((i, i + 1) for i in range(0, size - 1, 2)))  # every other neighbour pair is slow
    order = topology.ring_order(size, slow)
    assert sorted(order) == list(range(size))
    assert topology.slow_edges(order, slow) == 0 < topology.slow_edges(tuple(range(size)), slow)
    assert topology.ring_order(size, slow) == order  # deterministic


def test_every_rank_agrees_on_the_links_either_end_reported(tmp_path):
    store = FileStore(tmp_path)  # one folder: what each rank's own store object reads
    said = {0: [2], 1: [], 2: []}  # only rank 0 saw its path to rank 2 as relayed
    for r in range(3):
        store.set(f"erdma/slow/{r}", ",".join(map(str, said[r])).encode())
    got = [topology.agree(store, r, 3, said[r], 1.0) for r in range(3)]
    assert got == [links((0, 2))] * 3


def test_a_ring_allreduce_in_another_order_sums_bit_for_bit(erdma_world):
    with erdma_world(4) as world:
        outs = world.run(_permuted_ring)
    want = sum(((np.arange(10_000) * (k + 1)) % 1000).astype(np.float32) for k in range(4))
    for rank, (ring, peers, out) in enumerate(outs):
        assert ring == (0, 1, 3, 2)  # no slow pair side by side
        at = ring.index(rank)
        assert peers == ({ring[(at + 1) % 4]}, {ring[at - 1]})  # sends to the right, receives from the left
        assert np.array_equal(out, want)


def _permuted_ring(pg):  # the runtime's agreed links, as relayed paths would have made them
    pg.slow_links = links((1, 2), (3, 0))
    g = pg.new_group(list(range(4)))
    arr = ((np.arange(10_000) * (g.rank() + 1)) % 1000).astype(np.float32)
    g.allreduce(arr, algorithm="ring")
    (compiled,) = g.runner._plans.values()
    stages = compiled.program.stages
    return g.ring, ({m.to for st in stages for m in st.sends}, {m.to for st in stages for m in st.recvs}), arr



def test_agree_paths_reorders_the_default_groups_ring_when_a_path_moved(erdma_world):
    """``pg.agree_paths()``, called by every rank: rank 1 now reaches rank 2 through a relay (as erdma-quic's
    ``slow_peers`` says after a direct path failed over); every rank ends with the same links and a ring with 1
    and 2 apart, a ring allreduce in it sums bit for bit; a second round with nothing moved changes nothing, a
    subgroup refuses the call, and once the path is direct again the ring is the first one."""
    with erdma_world(4) as world:
        outs = world.run(_moved)
    want = sum(((np.arange(10_000) * (k + 1)) % 1000).astype(np.float32) for k in range(4))
    for before, changed, after, again, out, refused in outs:
        assert before == (0, 1, 2, 3) and changed and after == (0, 1, 3, 2) and again is False, (before, after)
        assert np.array_equal(out, want)
        assert "agree_paths() is called on the default group (the whole job); this is group 1" in refused


def _moved(pg):
    before = pg.ring
    if pg.rank() == 1:
        pg.transport.slow_peers = lambda: {2}  # what a transport whose path to rank 2 moved to a relay says
    changed = pg.agree_paths()
    after = pg.ring
    arr = ((np.arange(10_000) * (pg.rank() + 1)) % 1000).astype(np.float32)
    pg.allreduce(arr, algorithm="ring")
    again = pg.agree_paths()
    sub = pg.new_group(list(range(4)))
    try:
        sub.agree_paths()
        refused = ""
    except Exception as exc:
        refused = str(exc)
    if pg.rank() == 1:
        del pg.transport.slow_peers  # the path is direct again: so is the ring (and the shared world as it was)
    assert pg.agree_paths() and pg.ring == before and not pg.slow_links
    return before, changed, after, again, arr, refused
