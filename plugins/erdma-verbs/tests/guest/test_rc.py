"""The queue-pair layer on SoftRoCE: two RC queue pairs on one rxe device (rxe loops packets to its own
address back through the full RoCEv2 path) exchange a SEND with immediate and an RDMA WRITE with immediate
gathered from two segments, byte for byte, and one-segment writes posted one after another from the queue
pair's one request (the C side fills it per post); a bad transition, a bad request and a missing device are
named; the completion channel wakes a sleeper."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from erdma_verbs import rc

DEVICE = "rxe0"


def poll(dev: rc.Device, count: int, timeout: float = 60.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += dev.poll(count - len(got))
        time.sleep(0.001)
    assert len(got) == count, f"{len(got)} of {count} completions"
    for wc in got:
        assert wc.status == rc.WC_SUCCESS, rc.status_name(wc.status)
    return got


@pytest.fixture(params=[False, True], ids=["poll", "channel"])
def pair(request):
    a, b = rc.Device(DEVICE, channel=request.param), rc.Device(DEVICE, channel=request.param)
    qa, qb = a.queue_pair(8), b.queue_pair(8)
    qa.connect(qb.address())
    qb.connect(qa.address())
    yield a, qa, b, qb
    a.close()
    b.close()


def test_send_with_immediate(pair):
    a, qa, b, qb = pair
    data = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    got = np.zeros_like(data)
    mr_a, mr_b = a.register(data), b.register(got)
    qb.post_recv(7, got.ctypes.data, got.nbytes, mr_b.lkey)
    qa.send_imm(8, 0x7FFF_0001, data.ctypes.data, data.nbytes, mr_a.lkey)
    assert [wc.wr_id for wc in poll(a, 1)] == [8]
    (wc,) = poll(b, 1)
    assert (wc.wr_id, wc.opcode, wc.byte_len, wc.imm_data) == (7, rc.WC_RECV, data.nbytes, 0x7FFF_0001)
    assert np.array_equal(got, data)


def test_write_with_immediate_gathers_two_segments_into_the_peers_buffer(pair):
    a, qa, b, qb = pair
    head = np.arange(64, dtype=np.uint8)
    data = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    target = np.zeros(64 + data.nbytes, np.uint8)
    mr_t, small = b.register(target), np.zeros(1, np.uint8)
    qb.post_recv(1, small.ctypes.data, 1, b.register(small).lkey)  # the immediate's receive: one SGE needed
    mr_h, mr_d = a.register(head), a.register(data, 0)  # a send-only region needs no access flags
    qa.write_imm(2, [(head.ctypes.data, 64, mr_h.lkey), (data.ctypes.data, data.nbytes, mr_d.lkey)],
                 target.ctypes.data, mr_t.rkey, 64 + data.nbytes)
    poll(a, 1)
    (wc,) = poll(b, 1)
    assert wc.opcode == rc.WC_RECV_WRITE and wc.imm_data == 64 + data.nbytes
    assert np.array_equal(target[:64], head) and np.array_equal(target[64:], data)


def test_writes_posted_back_to_back_carry_each_posts_length_target_and_immediate(pair):
    """Every post fills the queue pair's one request (``ibv.c``): each of 30 writes over 6 different segments,
    six posted before any completes, must still carry its own target, immediate and id."""
    a, qa, b, qb = pair
    data = np.random.default_rng(3).integers(0, 256, 8192, dtype=np.uint8)
    target, small = np.zeros(30 * 2048, np.uint8), np.zeros(1, np.uint8)
    mr_d, mr_t, mr_s = a.register(data), b.register(target), b.register(small)
    want = np.zeros_like(target)
    for batch in range(5):
        qb.post_recv(1, small.ctypes.data, 1, mr_s.lkey, count=6)
        sent = []
        for i in range(batch * 6, batch * 6 + 6):
            off, n = (i % 3) * 1000, (i % 2 + 1) * 700
            qa.write_imm(100 + i, [(data.ctypes.data + off, n, mr_d.lkey)], target.ctypes.data + i * 2048,
                         mr_t.rkey, i * 10 + n)
            want[i * 2048:i * 2048 + n] = data[off:off + n]
            sent.append(i)
        assert [wc.wr_id for wc in poll(a, 6)] == [100 + i for i in sent]
        assert [wc.imm_data for wc in poll(b, 6)] == [i * 10 + (i % 2 + 1) * 700 for i in sent]
    assert np.array_equal(target, want)


def test_a_transition_that_fails_is_named(pair):
    qa = pair[1]
    with pytest.raises(rc.VerbsError, match=r"queue pair \d+: the move to INIT failed"):
        qa.to_init()  # already in RTS: RTS -> INIT is not a transition verbs allow


def test_a_request_verbs_cannot_take_is_refused_naming_it(pair):
    a, qa = pair[0], pair[1]
    data = np.zeros(64, np.uint8)
    mr = a.register(data)
    with pytest.raises(rc.VerbsError, match=r"^3 segments \(1 to 2\)$"):
        qa.write_imm(1, [(data.ctypes.data, 8, mr.lkey)] * 3, 0, 0, 0)
    a.close_region(mr)


def test_a_device_that_is_not_there_is_named():
    with pytest.raises(rc.VerbsError, match=r"^mlx5_9 port 1: no such device$"):
        rc.Device("mlx5_9")
    assert rc.device_names() == [DEVICE]


def test_the_completion_channel_wakes_a_sleeper():
    a, b = rc.Device(DEVICE, channel=True), rc.Device(DEVICE)
    try:
        qa, qb = a.queue_pair(4), b.queue_pair(4)
        qa.connect(qb.address())
        qb.connect(qa.address())
        mine, theirs = np.zeros(8, np.uint8), np.ones(8, np.uint8)
        mr_a, mr_b = a.register(mine), b.register(theirs)
        qa.post_recv(1, mine.ctypes.data, 8, mr_a.lkey)
        a.arm()
        assert a.poll(1) == []
        sender = threading.Timer(0.5, qb.send_imm, (2, 5, theirs.ctypes.data, 8, mr_b.lkey))
        start = time.monotonic()
        sender.start()
        assert a.sleep(30)  # returns on the completion, not at 30 s
        sender.join()
        assert 0.4 < time.monotonic() - start < 20
        (wc,) = poll(a, 1)
        assert wc.imm_data == 5 and np.array_equal(mine, theirs)
    finally:
        a.close()
        b.close()
