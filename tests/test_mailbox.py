"""The sans-IO matching core, driven without sockets (h11/aioquic style)."""

from __future__ import annotations

import threading

import pytest

from erdma_core.errors import MismatchError, ProtocolError
from erdma_core.transport.mailbox import Mailbox
from erdma_core.transport.request import Request
from erdma_core.wire import DATA, FRAME, Header

JOB = 0xABCDEF0123


def hdr(seq=1, tag=0, nbytes=4, numel=1, dtype=3, group=0, job=JOB, codec=0, count=None):
    """An allreduce(SUM) frame of float32 (``count``: raw elements, nbytes // 4 unless given)."""
    return Header(kind=DATA, job=job, dtype=dtype, opcode=1, redop=1, group=group, seq=seq, tag=tag, numel=numel,
                  count=nbytes // 4 if count is None else count, nbytes=nbytes, codec=codec)


def deliver(box, peer, h, payload):
    buf, token = box.frame(peer, h)
    if buf is not None:
        buf[:] = payload
    box.landed(token)


def test_posted_receive_gets_payload_in_place():
    box, out = Mailbox(0, JOB), bytearray(4)
    req = box.post_recv(1, hdr(), memoryview(out))
    buf, token = box.frame(1, hdr())
    assert buf.obj is out  # the payload lands in the receiver's own memory
    buf[:] = b"abcd"
    box.landed(token)
    assert req.done() and out == b"abcd"


def test_early_frame_is_kept_until_posted_and_matched_by_tag():
    box = Mailbox(0, JOB)
    deliver(box, 1, hdr(tag=1), b"2222")
    deliver(box, 1, hdr(tag=0), b"1111")
    a, b = bytearray(4), bytearray(4)
    box.post_recv(1, hdr(tag=0), memoryview(a)).wait(1)
    box.post_recv(1, hdr(tag=1), memoryview(b)).wait(1)
    assert (a, b) == (b"1111", b"2222")


def test_receive_posted_while_early_payload_is_in_flight():
    box, out = Mailbox(0, JOB), bytearray(4)
    buf, token = box.frame(1, hdr())
    req = box.post_recv(1, hdr(), memoryview(out))
    assert not req.done()
    buf[:] = b"wxyz"
    box.landed(token)
    assert req.wait(1) and out == b"wxyz"


def test_frame_of_another_job_is_rejected():
    box = Mailbox(0, JOB)
    with pytest.raises(ProtocolError, match="carries job 0x1, this job is 0xcdef0123"):
        box.frame(1, hdr(job=1))


def test_a_frame_no_collective_took_is_a_mismatch_not_mixed_in():
    """Every message of a collective is received in it; one left over means the ranks ran it differently."""
    told = []
    box = Mailbox(0, JOB, on_mismatch=told.append)
    deliver(box, 1, hdr(seq=4), b"old!")  # arrived early for seq 4 ...
    err = box.begin(0, 5)                 # ... but this rank has moved on to seq 5 without taking it
    assert isinstance(err, MismatchError) and box.rejected == 1
    assert "rank 1 sent a message of collective #4 of group 0 (allreduce(dtype=float32, numel=1, count=1, " \
           "op=SUM)) that this rank never received" in str(err)
    buf, token = box.frame(1, hdr(seq=3))  # a late frame of an older collective: read, dropped, reported
    assert buf is None and token is None and box.rejected == 2
    assert len(told) == 1 and "collective #3" in str(told[0])


def test_a_frame_of_a_collective_run_on_a_transports_own_path_is_a_stray_of_that_collective_only():
    """While this rank runs seq 5 on a transport's own path (``Transport.run_program``), posting no receive, a
    frame of seq 5 that came through the messages means its sender ran something else there."""
    box = Mailbox(0, JOB)
    box.begin(0, 5)
    deliver(box, 2, hdr(seq=6), b"next")  # a fast peer's next collective: not this one's business
    deliver(box, 1, hdr(seq=5, group=3), b"othr")  # another group's seq 5
    assert box.stray(0, 5) is None
    deliver(box, 1, hdr(seq=5), b"five")
    err = box.stray(0, 5)
    assert isinstance(err, MismatchError)
    assert "rank 1 sent a message of collective #5 of group 0 (allreduce(dtype=float32, numel=1, count=1, " \
           "op=SUM)) that this rank never received" in str(err)


def test_a_frame_of_the_op_under_way_that_disagrees_fails_its_receives():
    """A rank that runs seq 5 as another op (or root) than this one: the receive posted for seq 5 from any
    peer fails at once, naming both, though the frame came from a peer this rank did not expect."""
    box = Mailbox(0, JOB)
    box.begin(0, 5)
    req = box.post_recv(2, hdr(seq=5), memoryview(bytearray(4)))
    other = hdr(seq=5)._replace(opcode=2, redop=0, root=1)  # rank 1: broadcast from root 1
    assert box.frame(1, other) == (None, None)
    with pytest.raises(MismatchError, match=r"rank 1 called broadcast\(dtype=float32, numel=1, count=1, root=1\)"):
        req.wait(1)


def test_mismatch_fails_the_receive_with_both_descriptions():
    box = Mailbox(2, JOB)
    req = box.post_recv(1, hdr(nbytes=8, numel=2), memoryview(bytearray(8)))
    buf, token = box.frame(1, hdr(nbytes=4, numel=1))
    assert buf is None  # the payload is read and discarded
    box.landed(token)
    with pytest.raises(MismatchError, match=r"allreduce mismatch between ranks 2 and 1: rank 2 called "
                                            r"allreduce\(dtype=float32, numel=2, count=2, op=SUM\), rank 1 called"):
        req.wait(1)


def test_abort_fails_pending_and_later_receives():
    box = Mailbox(0, JOB)
    req = box.post_recv(1, hdr(), memoryview(bytearray(4)))
    box.abort(RuntimeError("first"))
    box.abort(RuntimeError("second"))
    with pytest.raises(RuntimeError, match="first"):
        req.wait(1)
    with pytest.raises(RuntimeError, match="first"):
        box.post_recv(1, hdr(tag=9), memoryview(bytearray(4))).wait(1)


def test_a_peers_abort_fails_the_receives_and_counts_it_among_those_tearing_down():
    """An ABORT frame from rank 2 (through its inbox, as every transport delivers it): receives fail with its
    reason, and rank 2 is in ``unwaited`` (a closing transport does not wait for its acknowledgements), as
    is rank 1, the loss its word names."""
    from erdma_core.errors import PeerLostError
    from erdma_core.transport.frames import FrameInbox
    from erdma_core.wire import ABORT, abort_body, control

    box = Mailbox(0, JOB)
    req = box.post_recv(1, hdr(), memoryview(bytearray(4)))
    body = abort_body(PeerLostError("rank 2: rank 1 is gone", peer=1, rank=2))
    FrameInbox(0, 2, box).whole(control(ABORT, JOB, nbytes=len(body)), memoryview(body))
    with pytest.raises(PeerLostError, match="rank 0: rank 2 aborted the job: rank 2: rank 1 is gone") as got:
        req.wait(1)
    assert got.value.peer == 1 and box.unwaited == {1, 2}  # (rank 1: the loss the word names)


@pytest.mark.parametrize("data", [b"", b"ERDF", b"XXXX" + bytes(FRAME.size - 4), b"ERDF\x09" + bytes(FRAME.size - 5)])
def test_bad_frame_headers_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        Header.parse(data)


def test_fuzzed_headers_never_crash_differently():
    import random

    rng = random.Random(1)
    for _ in range(2000):
        data = bytes(rng.getrandbits(8) for _ in range(FRAME.size))
        if rng.random() < 0.5:
            data = b"ERDF" + data[4:]
        try:
            Header.parse(data)
        except ProtocolError:
            pass


def test_abort_reaches_a_receive_whose_payload_is_still_arriving():
    """The peer dies mid-payload: the matched receive must fail at once, not wait for its deadline."""
    box = Mailbox(0, JOB)
    req = box.post_recv(1, hdr(nbytes=8, numel=2), memoryview(bytearray(8)))
    buf, token = box.frame(1, hdr(nbytes=8, numel=2))
    assert buf is not None and not req.done()
    box.abort(ConnectionError("peer 1 gone"))
    with pytest.raises(ConnectionError, match="peer 1 gone"):
        req.wait(1)
    box.landed(token)  # a late end of the payload changes nothing
    assert isinstance(req.error, ConnectionError)


def test_encoded_payload_lands_apart_and_is_bounded():
    """A compressed message cannot land in the receiver's memory: it gets a buffer of its own, no larger than
    the raw size allows, and the completed request carries it for the engine to decode."""
    box, out = Mailbox(0, JOB), bytearray(4000)
    req = box.post_recv(1, hdr(nbytes=4000, numel=1000), memoryview(out))
    buf, token = box.frame(1, hdr(nbytes=100, numel=1000, count=1000, codec=0xABC))
    assert buf is not None and buf.obj is not out and len(buf) == 100
    buf[:] = b"x" * 100
    box.landed(token)
    assert req.wait(1) and req.encoded is not None and bytes(req.encoded[1]) == b"x" * 100
    assert req.encoded[0].codec == 0xABC and out == bytearray(4000)
    huge = box.post_recv(1, hdr(tag=1, nbytes=4000, numel=1000), memoryview(out))
    buf, token = box.frame(1, hdr(tag=1, nbytes=1 << 30, numel=1000, count=1000, codec=0xABC))
    assert buf is None  # read and dropped, never allocated
    box.landed(token)
    with pytest.raises(ProtocolError, match=r"sent 1073741824 encoded bytes for 4000 raw bytes \(at most 70036 allowed\)"):
        huge.wait(1)


def test_raw_payload_of_the_wrong_size_is_refused():
    box = Mailbox(0, JOB)
    req = box.post_recv(1, hdr(nbytes=8, numel=2), memoryview(bytearray(8)))
    buf, token = box.frame(1, hdr(nbytes=12, numel=2, count=2))
    assert buf is None
    box.landed(token)
    with pytest.raises(ProtocolError, match="rank 1 sent 12 raw bytes for 2 elements of float32; 8 expected"):
        req.wait(1)


def test_peer_that_closed_fails_only_receives_from_it():
    box = Mailbox(0, JOB)
    from_1 = box.post_recv(1, hdr(), memoryview(bytearray(4)))
    from_2 = box.post_recv(2, hdr(), memoryview(bytearray(4)))
    box.peer_gone(1, ConnectionError("rank 1 closed its process group"))
    with pytest.raises(ConnectionError, match="rank 1 closed"):
        from_1.wait(1)
    assert not from_2.done()  # rank 2 is still sending
    deliver(box, 2, hdr(), b"okay")
    assert from_2.wait(1)
    with pytest.raises(ConnectionError):
        box.post_recv(1, hdr(tag=5), memoryview(bytearray(4))).wait(1)


def test_frames_that_arrived_before_a_peer_closed_are_still_delivered():
    box, out = Mailbox(0, JOB), bytearray(4)
    deliver(box, 1, hdr(), b"last")  # e.g. a broadcast root's data, then its BYE
    box.peer_gone(1, ConnectionError("rank 1 closed its process group"))
    assert box.post_recv(1, hdr(), memoryview(out)).wait(1) and out == b"last"


def _in_two_calls(box, peer, h, payload):
    buf, token = box.frame(peer, h)
    if buf is not None:
        buf[:] = payload
    box.landed(token)


def _whole(box, peer, h, payload):
    box.whole(peer, h, memoryview(payload))


def _scenario(arrive, name):
    """What a frame does to a mailbox, delivered by ``arrive``: the receives' outcomes (their errors' types
    and messages, their memory, what came encoded), the mismatches reported and the frames rejected."""
    told = []
    box, out, other = Mailbox(0, JOB, on_mismatch=told.append), bytearray(8), bytearray(4)
    reqs = []
    if name == "posted":
        reqs.append(box.post_recv(1, hdr(nbytes=8, numel=2), memoryview(out)))
        arrive(box, 1, hdr(nbytes=8, numel=2), b"abcdefgh")
    elif name == "early":
        arrive(box, 1, hdr(nbytes=8, numel=2), b"abcdefgh")
        reqs.append(box.post_recv(1, hdr(nbytes=8, numel=2), memoryview(out)))
    elif name == "other size":
        reqs.append(box.post_recv(1, hdr(nbytes=8, numel=2), memoryview(out)))
        arrive(box, 1, hdr(nbytes=4, numel=1), b"abcd")
    elif name == "wrong raw bytes":
        reqs.append(box.post_recv(1, hdr(nbytes=8, numel=2), memoryview(out)))
        arrive(box, 1, hdr(nbytes=4, numel=2, count=2), b"abcd")
    elif name == "encoded":
        reqs.append(box.post_recv(1, hdr(nbytes=8, numel=2), memoryview(out)))
        arrive(box, 1, hdr(nbytes=3, numel=2, count=2, codec=0xABC), b"xyz")
    elif name == "stale":
        box.begin(0, 5)
        arrive(box, 1, hdr(seq=4), b"old!")
    elif name == "another op under way":
        box.begin(0, 5)
        reqs.append(box.post_recv(2, hdr(seq=5), memoryview(other)))
        arrive(box, 1, hdr(seq=5)._replace(opcode=2, redop=0, root=1), b"root")
    elif name == "p2p":
        reqs.append(box.post_recv(1, hdr(group=1 << 31, seq=3), memoryview(other)))
        arrive(box, 1, hdr(group=1 << 31, seq=3), b"p2p!")
    results = []
    for r in reqs:
        r.settled(1)
        enc = None if r.encoded is None else (r.encoded[0].codec, bytes(r.encoded[1]))
        results.append((r.done(), type(r.error).__name__, str(r.error), enc))
    return results, bytes(out), bytes(other), [str(e) for e in told], box.rejected


@pytest.mark.parametrize("name", ["posted", "early", "other size", "wrong raw bytes", "encoded", "stale",
                                  "another op under way", "p2p"])
def test_a_whole_frame_at_once_does_what_header_then_payload_do(name):
    """``whole`` (a reader holding the whole frame) takes a shortcut for the common case; every case
    must end exactly as ``frame`` + ``landed`` end it."""
    got, want = _scenario(_whole, name), _scenario(_in_two_calls, name)
    assert got == want
    assert any(want)  # the scenario did something to compare
    if name == "posted":
        assert want[0] == [(True, "NoneType", "None", None)] and want[1] == b"abcdefgh"


def test_a_whole_frame_of_another_job_is_rejected():
    with pytest.raises(ProtocolError, match="carries job 0x1, this job is 0xcdef0123"):
        Mailbox(0, JOB).whole(1, hdr(job=1), memoryview(b"abcd"))


@pytest.mark.parametrize("seed", range(12))
def test_stream_reader_takes_frames_in_any_slicing(seed):
    """Small frames come through the staging buffer several at a time; large ones land in place; every
    payload arrives intact whether its receive was posted before or after, however the stream is cut."""
    import random

    import numpy as np

    from erdma_core.transport.frames import FrameInbox, StreamReader

    rng = random.Random(seed)
    box = Mailbox(0, JOB)
    reader = StreamReader(FrameInbox(0, 1, box))
    sizes = [rng.choice([0, 1, 100, 5000, 40000, 70000, 300000]) for _ in range(20)]
    payloads = [np.random.default_rng(seed * 100 + i).integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)]
    outs = [np.zeros(n, np.uint8) for n in sizes]

    def h(i):
        return hdr(seq=i, nbytes=sizes[i], numel=sizes[i], dtype=9, count=sizes[i])

    reqs = {i: box.post_recv(1, h(i), memoryview(outs[i])) for i in range(len(sizes)) if i % 3}
    stream = b"".join(h(i).pack() + payloads[i].tobytes() for i in range(len(sizes)))
    pos = 0
    while pos < len(stream):
        buf = reader.buffer()
        k = min(len(buf), rng.randint(1, 100_000), len(stream) - pos)
        buf[:k] = stream[pos:pos + k]
        pos += k
        reader.advance(k)
    assert reader.between_frames
    for i in range(len(sizes)):
        req = reqs.get(i) or box.post_recv(1, h(i), memoryview(outs[i]))
        assert req.wait(1) and np.array_equal(outs[i], payloads[i]), (i, sizes[i])


def test_memory_of_a_delivered_early_frame_serves_the_next_one():
    """A large frame that came before its receive is held in memory of its own; once its payload is copied
    out that memory is kept for the next early frame (no allocation whose pages the kernel must zero), but
    never while anything still reads it: an encoded frame's payload goes to the engine to decode."""
    box, n = Mailbox(0, JOB), 1 << 20
    first, token = box.frame(1, hdr(tag=0, nbytes=n, numel=n // 4))
    first[:] = b"a" * n
    box.landed(token)
    out = bytearray(n)
    assert box.post_recv(1, hdr(tag=0, nbytes=n, numel=n // 4), memoryview(out)).wait(1) and out == b"a" * n
    again, token = box.frame(1, hdr(tag=1, nbytes=n, numel=n // 4))
    assert again.obj is first.obj  # the same memory, not cleared: every byte is read into it before use
    again[:] = b"b" * n
    box.landed(token)
    assert box.post_recv(1, hdr(tag=1, nbytes=n, numel=n // 4), memoryview(out)).wait(1) and out == b"b" * n
    coded, token = box.frame(1, hdr(tag=2, nbytes=n - 8, numel=n // 4, count=n // 4, codec=0xABC))
    assert coded.obj is first.obj  # (the spare fits: at most twice the size asked for)
    coded[:] = b"c" * (n - 8)
    box.landed(token)
    req = box.post_recv(1, hdr(tag=2, nbytes=n, numel=n // 4), memoryview(out))
    assert req.wait(1) and bytes(req.encoded[1]) == b"c" * (n - 8)
    later, token = box.frame(1, hdr(tag=3, nbytes=n, numel=n // 4))
    assert later.obj is not first.obj  # the encoded payload is still the engine's to decode
    box.landed(token)
    small, token = box.frame(1, hdr(tag=4, nbytes=64))
    assert isinstance(small.obj, bytearray)  # small frames are allocated afresh


def test_a_request_completed_while_threads_start_waiting_wakes_them_all():
    """``complete`` takes no lock: a waiter that makes its event as the request completes must still see it
    done (it looks again after making the event), and two waiters share one event."""
    for _ in range(300):
        req = Request()
        seen: list[bool] = []
        waiters = [threading.Thread(target=lambda r=req, s=seen: s.append(r.settled(2.0))) for _ in range(2)]
        for w in waiters:
            w.start()
        req.complete()
        for w in waiters:
            w.join(timeout=5)
        assert seen == [True, True]
