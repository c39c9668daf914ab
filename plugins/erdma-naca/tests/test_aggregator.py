"""The node's protocol without sockets: exact rank-order results, duplicates, lost results, slots and jobs."""

from __future__ import annotations

import random

import numpy as np
import pytest
from erdma_naca import header as H
from erdma_naca.aggregator import Aggregator

from erdma_core.toolkit import dtypes

SECRET = b"node secret, 32 bytes long......"
ADMISSION = H.admission_key(SECRET)


class Ranks:
    """The ranks of one job, speaking to an Aggregator directly. Rank r's address is ("rank", r); each rank's
    datagrams carry its own counter."""

    def __init__(self, agg: Aggregator, size: int, job: int = 0xABC, key: bytes = b"k" * 32, slots: int = 8) -> None:
        self.agg, self.size, self.job, self.key, self.slots = agg, size, job, key, slots
        self.counters = [0] * size
        self.node_key = H.node_key(key, agg.node_id)  # what JOIN_OK tells a rank (checked in join)

    def next(self, rank: int) -> int:
        self.counters[rank] += 1
        return self.counters[rank]

    def join(self, rank: int, now: float = 0.0) -> H.Header:
        """JOIN with the node's cookie (a CHALLENGE first); the node's last answer."""
        nonce, cookie = bytes([rank]) * 16, bytes(H.COOKIE)
        masked = H.xor(self.key, H.wrap_mask(ADMISSION, self.job, 0, nonce))
        for _ in range(2):
            d = H.pack(H.Header(H.JOIN, job=self.job, status=self.slots, rank=rank, size=self.size,
                                counter=self.next(rank)), nonce + masked + cookie, ADMISSION)
            [(_, out)] = self.agg.handle(d, ("rank", rank), now)
            h = H.peek(out)
            if h.kind != H.CHALLENGE:
                break
            cookie = bytes(H.verify(out, ADMISSION)[H.NONCE:])
        if h.kind == H.JOIN_OK:
            assert H.node_key(self.key, bytes(H.verify(out, self.key)[H.NONCE:])) == self.node_key
        return h

    def datagram(self, rank: int, h: H.Header, payload: bytes) -> bytes:
        """``h`` from ``rank`` with its next counter, tagged for the node."""
        return H.pack(h._replace(rank=rank, size=self.size, counter=self.next(rank)), payload, self.node_key)

    def data(self, rank: int, seq: int, values: np.ndarray, *, op: int = H.ALLREDUCE, redop: int = 1,
             offset: int = 0, total: int | None = None, flags: int = 0, root: int = H.NO_RANK,
             message: int = 1) -> list[tuple[object, H.Header, bytes]]:
        h = H.Header(H.DATA, op=op, dtype=dtypes.code_of(dtypes.name_for_numpy(values.dtype)), redop=redop,
                     flags=flags, job=self.job, message=message, seq=seq, offset=offset,
                     total=values.size if total is None else total, bitmap=1 << rank, root=root, count=values.size)
        payload = b"" if flags & H.NO_DATA else values.tobytes()
        return self.answers(self.agg.handle(self.datagram(rank, h, payload), ("rank", rank), 1.0))

    def answers(self, outs: list[tuple[object, bytes]]) -> list[tuple[object, H.Header, bytes]]:
        return [(addr, H.peek(d), bytes(H.verify(d, self.node_key)) if H.peek(d).kind != H.REJECT else b"")
                for addr, d in outs]


def test_sum_is_rank_order_whatever_the_arrival() -> None:
    agg = Aggregator(SECRET, 64, 16)
    job = Ranks(agg, 4)
    for r in range(4):
        assert job.join(r).kind == H.JOIN_OK
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(256).astype(np.float32) * 10 ** r for r in range(4)]
    expect = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    for seq, order in enumerate(([3, 1, 0, 2], [0, 1, 2, 3], [2, 3, 1, 0])):
        outs = []
        for r in order:
            outs = job.data(r, seq, xs[r])
        assert sorted(a for a, _, _ in outs) == [("rank", r) for r in range(4)]
        for _, h, payload in outs:
            assert h.kind == H.RESULT and h.bitmap == 0b1111
            assert np.frombuffer(payload, np.float32).tobytes() == expect.tobytes()


def test_duplicate_not_counted_twice_and_lost_result_sent_again() -> None:
    agg = Aggregator(SECRET, 64, 16)
    job = Ranks(agg, 3)
    for r in range(3):
        job.join(r)
    x = np.arange(8, dtype=np.int64)
    assert job.data(0, 0, x) == []
    [(addr, h, _)] = job.data(0, 0, x, flags=H.RETRY)  # a retransmission while the others are missing
    assert addr == ("rank", 0) and h.kind == H.PENDING and h.bitmap == 0b001
    job.data(1, 0, x)
    outs = job.data(2, 0, x)
    assert len(outs) == 3 and all(np.array_equal(np.frombuffer(p, np.int64), 3 * x) for _, _, p in outs)
    [(addr, h, p)] = job.data(1, 0, x, flags=H.RETRY)  # rank 1 lost its result
    assert addr == ("rank", 1) and h.kind == H.RESULT and np.array_equal(np.frombuffer(p, np.int64), 3 * x)
    assert agg.stats.duplicates == 2 and agg.stats.results == 1


def test_slot_keeps_last_result_until_next_chunk_completes() -> None:
    agg = Aggregator(SECRET, 64, 16)
    job = Ranks(agg, 2, slots=2)
    assert job.join(0).status == 2 and job.join(1).status == 2
    a, b = np.ones(4, np.int32), np.full(4, 2, np.int32)
    job.data(0, 0, a)
    job.data(1, 0, b)  # chunk 0 complete in slot 0
    job.data(0, 2, a)  # rank 0 moves on to chunk 2 (slot 0 again)
    [(_, h, p)] = job.data(1, 0, b, flags=H.RETRY)  # rank 1 asks for chunk 0 again: still there
    assert h.seq == 0 and np.array_equal(np.frombuffer(p, np.int32), a + b)
    assert job.data(0, 4, a) == []  # a rank cannot skip ahead of an incomplete chunk: ignored
    outs = job.data(1, 2, b)
    assert {h.seq for _, h, _ in outs} == {2}


def test_reduce_scatter_and_broadcast_go_to_who_needs_them() -> None:
    agg = Aggregator(SECRET, 64, 16)
    job = Ranks(agg, 2)
    job.join(0)
    job.join(1)
    x = np.arange(4, dtype=np.float64)
    job.data(0, 0, x, op=H.REDUCE_SCATTER, offset=4, total=8)
    outs = {a: h.kind for a, h, _ in job.data(1, 0, x, op=H.REDUCE_SCATTER, offset=4, total=8)}
    assert outs == {("rank", 0): H.DONE, ("rank", 1): H.RESULT}
    job.data(0, 1, x, op=H.BROADCAST, redop=0, root=0)
    outs2 = {a: (h.kind, p) for a, h, p in job.data(1, 1, x, op=H.BROADCAST, redop=0, root=0, flags=H.NO_DATA)}
    assert outs2 == {("rank", 0): (H.DONE, b""), ("rank", 1): (H.RESULT, x.tobytes())}


def test_disagreeing_contributions_are_an_error_to_every_rank() -> None:
    agg = Aggregator(SECRET, 64, 16)
    job = Ranks(agg, 2)
    job.join(0)
    job.join(1)
    job.data(0, 0, np.zeros(4, np.float32))
    outs = job.data(1, 0, np.zeros(4, np.int32))
    assert {a for a, _, _ in outs} == {("rank", 0), ("rank", 1)}
    assert all(h.kind == H.ERROR and h.status == H.MISMATCH for _, h, _ in outs)
    assert b"another rank" in outs[0][2]
    [(_, h, text)] = job.data(0, 1, np.zeros(2, np.float32), op=H.REDUCE_SCATTER, offset=1, total=4)
    assert h.kind == H.ERROR and b"crosses a rank's slice" in text


def test_jobs_are_isolated_and_unknown_jobs_rejected() -> None:
    agg = Aggregator(SECRET, 64, 16)
    a, b = Ranks(agg, 2, job=1, key=b"a" * 32), Ranks(agg, 2, job=2, key=b"b" * 32)
    for r in range(2):
        a.join(r)
        b.join(r)
    a.data(0, 0, np.full(4, 1, np.int64))
    b.data(0, 0, np.full(4, 100, np.int64))
    [(_, _, pa), _] = a.data(1, 0, np.full(4, 2, np.int64))
    [(_, _, pb), _] = b.data(1, 0, np.full(4, 200, np.int64))
    assert np.frombuffer(pa, np.int64).tolist() == [3] * 4 and np.frombuffer(pb, np.int64).tolist() == [300] * 4
    # job 2's key cannot speak for job 1, and job 1's key cannot join job 2
    forged = Ranks(agg, 2, job=1, key=b"b" * 32)
    assert forged.data(0, 1, np.ones(4, np.int64)) == []
    assert agg.stats.bad_tag == 1
    assert Ranks(agg, 2, job=2, key=b"a" * 32).join(0).status == H.JOB_KEY
    # a job the node never admitted: REJECT (tagged with the admission key), nothing allocated
    stranger = Ranks(agg, 2, job=99, key=b"c" * 32)
    [(_, h, _)] = stranger.data(0, 0, np.ones(4, np.int64))
    assert h.kind == H.REJECT and h.status == H.UNKNOWN_JOB
    assert set(agg.jobs) == {(1, 0), (2, 0)}


def test_admission_and_slot_quotas() -> None:
    agg = Aggregator(SECRET, slots=10, job_slots=6)
    wrong_key = H.admission_key(b"not the node's secret...........")
    nonce = b"n" * 16
    d = H.pack(H.Header(H.JOIN, job=5, status=4, rank=0, size=2),
               nonce + H.xor(b"k" * 32, H.wrap_mask(wrong_key, 5, 0, nonce)) + bytes(H.COOKIE), wrong_key)
    [(_, out)] = agg.handle(d, ("rank", 0), 0.0)
    assert H.peek(out).status == H.BAD_ADMISSION and not agg.jobs
    first = Ranks(agg, 2, job=1, slots=100)
    assert first.join(0).status == 6  # capped per job
    second = Ranks(agg, 2, job=2, slots=100)
    assert second.join(0).status == 4  # what is left of the pool
    third = Ranks(agg, 2, job=3)
    h = third.join(0)
    assert h.kind == H.REJECT and h.status == H.NO_SLOTS


def test_idle_jobs_expire_and_leave_frees_slots() -> None:
    agg = Aggregator(SECRET, slots=8, job_slots=8, idle_s=10.0)
    job = Ranks(agg, 2)
    job.join(0, now=0.0)
    job.join(1, now=0.0)
    assert agg.free == 0 and agg.expire(5.0) == 0
    assert agg.expire(20.0) == 1 and agg.free == 8
    job.join(0)
    job.join(1)
    for r in range(2):
        agg.handle(job.datagram(r, H.Header(H.LEAVE, job=job.job), b""), ("rank", r), 1.0)
    assert not agg.jobs


def test_a_job_forgotten_between_its_joins_ends_at_the_first_rank_it_lost() -> None:
    """Rank 0 joins; the job expires; rank 1's JOIN makes it again without rank 0. Rank 1's chunk waits
    for rank 0's, which this job never admitted: rank 0 is told the job is unknown, the job goes, and rank
    1's retry is told the same (it stops waiting); both JOIN again and the chunk completes."""
    agg = Aggregator(SECRET, slots=8, job_slots=8, idle_s=1.0)
    job = Ranks(agg, 2)
    assert job.join(0, now=0.0).kind == H.JOIN_OK
    assert agg.expire(3.0) == 1
    assert job.join(1, now=3.0).kind == H.JOIN_OK
    x = np.arange(4, dtype=np.int64)
    assert job.data(1, 0, x) == []  # held for rank 0
    [(to, h, _)] = job.data(0, 0, x)
    assert to == ("rank", 0) and h.kind == H.REJECT and h.status == H.UNKNOWN_JOB
    assert h.counter == job.counters[0] and not agg.jobs
    [(to, h, _)] = job.data(1, 0, x, flags=H.RETRY)
    assert to == ("rank", 1) and h.kind == H.REJECT and h.status == H.UNKNOWN_JOB
    for r in range(2):
        assert job.join(r).kind == H.JOIN_OK
    assert job.data(0, 0, x) == []
    outs = job.data(1, 0, x)
    assert sorted(a for a, _, _ in outs) == [("rank", 0), ("rank", 1)]
    assert all(h.kind == H.RESULT and np.frombuffer(p, np.int64).tolist() == [0, 2, 4, 6] for _, h, p in outs)
    assert agg.stats.unknown_job == 2


def test_a_rank_that_gives_up_ends_the_job_so_the_ranks_waiting_at_the_node_fail_over_too() -> None:
    """Rank 1 found the node silent and fails over: its LEAVE with GIVE_UP makes the node forget the job, and
    rank 0, which waits there for rank 1's chunk, is told the job is unknown at its next probe instead of
    PENDING. A GIVE_UP that arrives after the rank's next JOIN (overtaken on the way) ends nothing."""
    agg = Aggregator(SECRET, slots=8, job_slots=8, idle_s=60.0)
    job = _joined(agg)
    x = np.arange(4, dtype=np.int64)
    assert job.data(0, 0, x) == []  # held for rank 1
    [(_, h, _)] = job.data(0, 0, x, flags=H.RETRY)
    assert h.kind == H.PENDING
    plain = job.datagram(1, H.Header(H.LEAVE, job=job.job), b"")
    agg.handle(plain, ("rank", 1), 1.0)  # a LEAVE without GIVE_UP ends nothing while rank 0 has not left
    assert agg.jobs
    stale = job.datagram(1, H.Header(H.LEAVE, flags=H.GIVE_UP, job=job.job), b"")
    agg.handle(job.datagram(1, H.Header(H.LEAVE, flags=H.GIVE_UP, job=job.job), b""), ("rank", 1), 1.0)
    assert not agg.jobs and agg.stats.given_up == 1
    [(to, h, _)] = job.data(0, 0, x, flags=H.RETRY)
    assert to == ("rank", 0) and h.kind == H.REJECT and h.status == H.UNKNOWN_JOB
    for r in range(2):
        assert job.join(r).kind == H.JOIN_OK
    agg.handle(stale, ("rank", 1), 2.0)  # sent before rank 1's JOIN: the job stays
    assert agg.jobs and agg.stats.given_up == 1
    assert job.data(0, 0, x) == []
    assert {h.kind for _, h, _ in job.data(1, 0, x)} == {H.RESULT}


@pytest.mark.parametrize("dtype, redop", [("float16", 1), ("bfloat16", 4), ("int8", 2), ("bool", 8),
                                          ("uint8", 7), ("float64", 3)])
def test_every_dtype_reduces_like_the_core(dtype: str, redop: int) -> None:
    from erdma_core.toolkit import reduce_ops

    agg = Aggregator(SECRET, 64, 16)
    job = Ranks(agg, 3)
    for r in range(3):
        job.join(r)
    store = dtypes.storage(dtype)
    rng = random.Random(dtype)
    xs = [np.frombuffer(rng.randbytes(16 * store.itemsize), store).copy() for _ in range(3)]
    if dtype == "bool":
        xs = [x.view(np.uint8) & 1 for x in xs]
        xs = [x.astype(np.bool_) for x in xs]
    op = reduce_ops.ReduceOp[reduce_ops.NAMES[redop]]
    expect = xs[0].copy()
    with np.errstate(all="ignore"):
        for x in xs[1:]:
            reduce_ops.reduce_into(expect, x, op, dtype)
        h = H.Header(H.DATA, op=H.ALLREDUCE, dtype=dtypes.code_of(dtype), redop=redop, job=job.job, seq=0,
                     message=1, total=16, size=3, count=16)
        outs = []
        for r in range(3):
            outs = agg.handle(job.datagram(r, h._replace(bitmap=1 << r), xs[r].tobytes()), ("rank", r), 1.0)
    payload = bytes(H.verify(outs[0][1], job.node_key))
    assert payload == expect.tobytes()


# ---- replays: what a recorded datagram can do later ----------------------------------------------------------


def _joined(agg: Aggregator, size: int = 2) -> Ranks:
    job = Ranks(agg, size)
    for r in range(size):
        assert job.join(r).kind == H.JOIN_OK
    return job


def test_a_recorded_datagram_sent_again_is_dropped_and_moves_nothing() -> None:
    agg = Aggregator(SECRET, 64, 16, idle_s=10.0)
    job = _joined(agg)
    x = np.arange(4, dtype=np.int64)
    h = H.Header(H.DATA, op=H.ALLREDUCE, dtype=dtypes.code_of("int64"), redop=1, job=job.job, message=1, seq=0,
                 total=4, bitmap=1, count=4)
    recorded = job.datagram(0, h, x.tobytes())
    assert agg.handle(recorded, ("rank", 0), 1.0) == []
    job.data(1, 0, x)
    for addr, at in ((("attacker", 1), 2.0), (("rank", 0), 3.0), (("attacker", 2), 9.0)):
        assert agg.handle(recorded, addr, at) == []  # not the result, not a PENDING, not to anyone
    assert agg.stats.replays == 3 and agg.stats.results == 1
    assert agg.jobs[(job.job, 0)].addrs == {0: ("rank", 0), 1: ("rank", 1)}
    assert agg.expire(12.0) == 1  # the replays did not keep the job alive (its last real datagram: at 1.0)


def test_results_go_where_the_last_fresh_join_came_from() -> None:
    agg = Aggregator(SECRET, 64, 16)
    job = _joined(agg)
    x = np.ones(4, np.int32)
    h = H.Header(H.DATA, op=H.ALLREDUCE, dtype=dtypes.code_of("int32"), redop=1, job=job.job, message=1, seq=0,
                 total=4, bitmap=1, count=4)
    agg.handle(job.datagram(0, h, x.tobytes()), ("elsewhere", 0), 1.0)  # authentic, fresh, another address
    outs = job.data(1, 0, x)
    assert sorted(a for a, _, _ in outs) == [("rank", 0), ("rank", 1)]  # not "elsewhere": only a JOIN moves it


def test_a_recorded_join_cannot_move_a_rank() -> None:
    agg = Aggregator(SECRET, 64, 16)
    job = Ranks(agg, 2)
    nonce, masked = bytes(16), H.xor(job.key, H.wrap_mask(ADMISSION, job.job, 0, bytes(16)))
    first = H.pack(H.Header(H.JOIN, job=job.job, status=8, rank=0, size=2, counter=job.next(0)),
                   nonce + masked + bytes(H.COOKIE), ADMISSION)
    [(_, challenge)] = agg.handle(first, ("rank", 0), 0.0)
    assert H.peek(challenge).kind == H.CHALLENGE and len(challenge) <= len(first) and not agg.jobs
    cookie = bytes(H.verify(challenge, ADMISSION)[H.NONCE:])
    second = H.pack(H.Header(H.JOIN, job=job.job, status=8, rank=0, size=2, counter=job.next(0)),
                    nonce + masked + cookie, ADMISSION)
    [(_, ok)] = agg.handle(second, ("rank", 0), 0.5)
    assert H.peek(ok).kind == H.JOIN_OK
    # the same JOIN from elsewhere: the cookie is the rank's address's, so only a new CHALLENGE, to elsewhere
    [(to, again)] = agg.handle(second, ("attacker", 1), 1.0)
    assert to == ("attacker", 1) and H.peek(again).kind == H.CHALLENGE and len(again) <= len(second)
    # from the rank's own address once the rank has sent more: stale; and once the cookie has expired
    agg.handle(job.datagram(0, H.Header(H.LEAVE, job=job.job), b""), ("rank", 0), 2.0)
    assert agg.handle(second, ("rank", 0), 3.0) == []
    assert H.peek(agg.handle(second, ("rank", 0), 60.0)[0][1]).kind == H.CHALLENGE
    assert agg.jobs[(job.job, 0)].addrs == {0: ("rank", 0)}


def test_datagrams_for_one_node_are_worthless_at_another() -> None:
    """The job joined both nodes (one active, one standby, as after a failover): what was sent to one is
    dropped by the other."""
    active, standby = Aggregator(SECRET, 64, 16), Aggregator(SECRET, 64, 16)
    to_active, to_standby = _joined(active), _joined(standby)
    to_standby.counters = list(to_active.counters)
    x = np.ones(4, np.int32)
    h = H.Header(H.DATA, op=H.ALLREDUCE, dtype=dtypes.code_of("int32"), redop=1, job=0xABC, message=1, seq=0,
                 total=4, bitmap=1, count=4)
    for r in range(2):
        meant = to_active.datagram(r, h._replace(bitmap=1 << r), x.tobytes())
        assert standby.handle(meant, ("rank", r), 1.0) == []
    assert standby.stats.bad_tag == 2 and standby.stats.results == 0 and active.node_id != standby.node_id


def test_no_answer_is_larger_than_what_caused_it() -> None:
    """Every datagram the node cannot take as fresh from a joined rank (a JOIN, a JOIN without the cookie or
    with another secret, DATA of a job it does not know, a replay, garbage) gets an answer no larger than
    itself, or none."""
    agg = Aggregator(SECRET, 64, 16)
    job = _joined(agg)
    rng = random.Random(7)
    x = np.zeros(1, np.int8)
    small = H.Header(H.DATA, op=H.BROADCAST, dtype=dtypes.code_of("int8"), job=job.job, message=1, seq=0, total=1,
                     bitmap=2, root=0, count=1, flags=H.NO_DATA)
    replay = job.datagram(1, small, b"")
    agg.handle(replay, ("rank", 1), 0.0)
    job.data(0, 0, x, op=H.BROADCAST, redop=0, root=0)
    wrong = H.admission_key(b"another node's secret..........!")
    requests = [replay, Ranks(agg, 2, job=77).datagram(0, small._replace(job=77), b""),
                H.pack(H.Header(H.JOIN, job=5, status=4, rank=0, size=2), bytes(H.JOIN_PAYLOAD), ADMISSION),
                H.pack(H.Header(H.JOIN, job=5, status=4, rank=0, size=2), bytes(H.JOIN_PAYLOAD), wrong),
                H.pack(H.Header(H.JOIN, job=5, status=4, rank=0, size=2), b"", wrong)]
    requests += [rng.randbytes(rng.randrange(200)) for _ in range(200)]
    for request in requests:
        for _, out in agg.handle(request, ("attacker", 1), 1.0):
            assert len(out) <= len(request), H.describe(H.peek(out))
