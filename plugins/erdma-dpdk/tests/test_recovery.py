"""The shim's reliable stream over memif, byte for byte against numpy: packets dropped on arrival on purpose
(``inject_loss``) come back through selective retransmission, which the counters show happened; many small
frames share packets; a receive posted long after its data arrived still gets it."""

from __future__ import annotations

import time

import numpy as np

from .conftest import needs_dpdk

LOSSY = {"transport.name": "dpdk", "timeouts.collective": 60.0, "transport.dpdk.inject_loss": 0.05,
         "transport.dpdk.window": 32, "transport.dpdk.frame_bytes": 1500, "transport.dpdk.rto_min_us": 500}


def _exchange(pg, sizes):
    """Every rank sends random bytes of each size to the next rank and receives from the previous one."""
    me, n = pg.rank(), pg.size()
    ok = True
    for i, size in enumerate(sizes):
        mine = np.random.default_rng(1000 * i + me).integers(0, 256, size, dtype=np.uint8)
        want = np.random.default_rng(1000 * i + (me - 1) % n).integers(0, 256, size, dtype=np.uint8)
        got = np.zeros(size, np.uint8)
        works = [pg.isend(mine, (me + 1) % n, tag=i), pg.irecv(got, (me - 1) % n, tag=i)]
        for w in works:
            w.wait(60)
        ok &= bool(np.array_equal(got, want))
    counters = pg.transport.counters()
    return ok, sum(c["retransmits"] for c in counters.values()), sum(c["duplicates"] for c in counters.values())


@needs_dpdk
def test_lost_packets_are_sent_again_and_every_byte_arrives(erdma_world):
    sizes = [1, 1441, 1442, 100_000, 3 << 20]  # one packet's payload, one more byte, many packets
    results = erdma_world(3, LOSSY).run(_exchange, sizes)
    assert all(ok for ok, _, _ in results), results
    assert all(retransmits > 0 for _, retransmits, _ in results), results


def _small_frames(pg):
    """300 frames of 0-300 bytes each way, handed to the transport at once (below the process group, which has
    one message per peer on its way at a time), with a window of 8 packets that 30% loss keeps shut most of the
    time: those that wait for the window share packets."""
    from erdma_core.sdk import Header
    from erdma_core.toolkit import DATA, P2P_GROUP_BIT

    t, peer = pg.transport, 1 - pg.rank()

    def header(i, n):
        return Header(kind=DATA, job=t.job, group=P2P_GROUP_BIT | 77, seq=i, nbytes=n, numel=n, count=n)

    def payloads(rank):
        rng = np.random.default_rng(7 + rank)
        return [rng.integers(0, 256, int(k), dtype=np.uint8) for k in rng.integers(0, 300, 300)]

    want = payloads(peer)
    got = [np.zeros(w.size, np.uint8) for w in want]
    recvs = [t.irecv(peer, header(i, g.size), memoryview(g)) for i, g in enumerate(got)]
    sends = [t.isend(peer, header(i, m.size), memoryview(m), time.monotonic() + 60) for i, m in enumerate(payloads(
        pg.rank()))]
    for req in sends + recvs:
        assert t.wait(req, time.monotonic() + 60)
    return all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), t.counters()[peer]["data_packets"]


@needs_dpdk
def test_small_frames_share_packets(erdma_world):
    config = {**LOSSY, "transport.dpdk.window": 8, "transport.dpdk.inject_loss": 0.3}
    results = erdma_world(2, config).run(_small_frames)
    assert all(ok for ok, _ in results), results
    assert all(packets < 200 for _, packets in results), results  # 300 frames of 64 + 0-300 bytes


def _late_receive(pg):
    peer = 1 - pg.rank()
    data = np.arange(1 << 18, dtype=np.int32) * (pg.rank() + 1)
    pg.isend(data, peer, tag=5).wait(30)
    pg.barrier()  # the peer's message has arrived by now, before its receive is posted
    got = np.zeros(1 << 18, np.int32)
    pg.irecv(got, peer, tag=5).wait(30)
    return bool(np.array_equal(got, np.arange(1 << 18, dtype=np.int32) * (peer + 1)))


@needs_dpdk
def test_a_message_that_arrives_before_its_receive_is_kept(erdma_world):
    assert erdma_world(2, {"transport.name": "dpdk"}).run(_late_receive) == [True, True]
