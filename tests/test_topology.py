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
    pg.rt.slow_links = links((1, 2), (3, 0))
    g = pg.new_group(list(range(4)))
    arr = ((np.arange(10_000) * (g.rank() + 1)) % 1000).astype(np.float32)
    g.allreduce(arr, algorithm="ring")
    (compiled,) = g.runner._plans.values()
    stages = compiled.program.stages
    return g.ring, ({m.to for st in stages for m in st.sends}, {m.to for st in stages for m in st.recvs}), arr

