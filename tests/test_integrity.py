"""Frame integrity: a byte changed anywhere in a frame (header, seal or payload; on the way to either end) is
an ``IntegrityError`` on every rank, naming the peer and the link, and never a wrong result. The sans-IO
seal and check first (every byte of a frame flipped in turn, replays, frames of another connection), then
real 2-rank jobs through a proxy that changes one byte (``testflip``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from erdma_core import IntegrityError
from erdma_core.security import integrity
from erdma_core.transport.frames import DIRECT_BYTES, FrameInbox, StreamReader
from erdma_core.transport.mailbox import Mailbox
from erdma_core.wire import ABORT, DATA, FRAME, Header, abort_body, control

JOB = 0x5EC0
HEAD = FRAME.size + integrity.SEAL.size


def _pair(transcript: bytes = b"t" * 40) -> tuple[integrity.Sealer, integrity.Checker]:
    send, _ = integrity.keys(b"k" * 32, transcript, True)
    _, receive = integrity.keys(b"k" * 32, transcript, False)
    return integrity.Sealer(send), integrity.Checker(receive, rank=0, peer=1, where="TCP a -> b")


def _header(n: int, tag: int = 0) -> Header:
    return Header(kind=DATA, job=JOB, dtype=9, opcode=1, redop=1, seq=1, tag=tag, numel=n, count=n, nbytes=n)


def _frame(sealer: integrity.Sealer, payload: bytes, tag: int = 0) -> bytes:
    """The bytes of one sealed frame as a sender writes them (a large one through its ``SealedFrame``, in
    writes of 100,000 bytes)."""
    head, tail = sealer.seal(_header(len(payload), tag).pack(), memoryview(payload))
    if tail is not None:
        return head + payload + tail  # type: ignore[operator]
    assert isinstance(head, integrity.SealedFrame)
    out = bytearray()
    while head.left:
        part = b"".join(bytes(v) for v in head.views())[:100_000]
        head.wrote(len(part))
        out += part
    return bytes(out)


def _reader(check: integrity.Checker) -> tuple[StreamReader, Mailbox]:
    box = Mailbox(0, JOB)
    return StreamReader(FrameInbox(0, 1, box), check), box


def _feed(reader: StreamReader, stream: bytes, cut: int) -> None:
    at = 0
    while at < len(stream):
        buf = reader.buffer()
        n = min(len(buf), cut, len(stream) - at)
        buf[:n] = stream[at:at + n]
        reader.advance(n)
        at += n


@pytest.mark.parametrize("cut", [1, 7, 1 << 16])
def test_sealed_frames_land(cut):
    sealer, check = _pair()
    payloads = [os.urandom(n) for n in (0, 5, 300, DIRECT_BYTES + 11, 3 * integrity.PIECE + 5)]
    reader, box = _reader(check)
    outs = [bytearray(len(p)) for p in payloads]
    reqs = [box.post_recv(1, _header(len(p), tag), memoryview(o))
            for tag, (p, o) in enumerate(zip(payloads, outs, strict=True))]
    _feed(reader, b"".join(_frame(sealer, p, tag) for tag, p in enumerate(payloads)), cut)
    assert all(r.wait(0) for r in reqs)
    assert [bytes(o) for o in outs] == payloads
    assert reader.between_frames


def test_a_payload_tagged_at_once_lands_as_one_tagged_piece_by_piece():
    """``Sealer.whole`` (erdma-dpdk's shim writes the payload itself) gives the same tag as the pieces."""
    sealer, check = _pair()
    payloads = [b"", os.urandom(5), os.urandom(2 * integrity.PIECE + 3)]
    reader, box = _reader(check)
    outs = [bytearray(len(p)) for p in payloads]
    reqs = [box.post_recv(1, _header(len(p), tag), memoryview(o))
            for tag, (p, o) in enumerate(zip(payloads, outs, strict=True))]
    for tag, payload in enumerate(payloads):
        head, tail = sealer.whole(_header(len(payload), tag).pack(), memoryview(payload))
        _feed(reader, head + payload + tail, 5000)
    assert all(r.wait(0) for r in reqs) and [bytes(o) for o in outs] == payloads


@pytest.mark.parametrize("size", [1, 300, DIRECT_BYTES + 11, integrity.PIECE + 1])
@pytest.mark.parametrize("posted", [True, False])
def test_every_byte_of_a_frame_flipped_fails_the_check(size, posted):
    """Small and large payloads, to a posted receive or early: each byte of the frame flipped in turn (a sample
    of a large payload's) fails, and the receive never completes."""
    sealer, check = _pair()
    frame = _frame(sealer, os.urandom(size))
    tail = len(frame) - integrity.TAG
    spots = range(len(frame)) if size < 1000 else [*range(HEAD), *range(HEAD, tail, 4999), *range(tail, len(frame))]
    for at in spots:
        bad = bytearray(frame)
        bad[at] ^= 0x01
        reader, box = _reader(integrity.Checker(check._mac._key, rank=0, peer=1, where="TCP a -> b"))
        req = box.post_recv(1, _header(size), memoryview(bytearray(size))) if posted else None
        with pytest.raises(IntegrityError, match="integrity check failed on a frame from rank 1 over TCP a -> b"):
            _feed(reader, bytes(bad), 4096)
        assert req is None or not req.done()
        assert not box._unexpected or not any(e.landed for e in box._unexpected.values())


def test_a_reader_takes_nothing_more_after_a_failed_check():
    sealer, check = _pair()
    reader, box = _reader(check)
    bad = bytearray(_frame(sealer, b"x" * 100))
    bad[HEAD + 3] ^= 1
    with pytest.raises(IntegrityError):
        _feed(reader, bytes(bad), 1 << 16)
    req = box.post_recv(1, _header(10, tag=1), memoryview(bytearray(10)))
    _feed(reader, _frame(sealer, b"y" * 10, tag=1), 1 << 16)  # a good frame after it: dropped
    assert not req.done()


def test_a_replayed_frame_fails_and_frames_may_come_out_of_order_within_the_window():
    sealer, check = _pair()
    frames = [_frame(sealer, bytes([i]) * 8, tag=i) for i in range(3)]
    reader, _ = _reader(check)
    _feed(reader, frames[1] + frames[0], 1 << 16)  # sealed 0, 1; sent 1, 0 (an urgent frame overtook)
    with pytest.raises(IntegrityError, match="frame 2 came again"):
        _feed(reader, frames[1], 1 << 16)


def test_a_frame_older_than_the_window_fails():
    sealer, check = _pair()
    old = _frame(sealer, b"o")
    reader, _ = _reader(check)
    _feed(reader, b"".join(_frame(sealer, b"n", tag=i + 1) for i in range(integrity.WINDOW)), 1 << 16)
    with pytest.raises(IntegrityError, match="frame 1 came again or too late"):
        _feed(reader, old, 1 << 16)


def test_a_frame_of_another_connection_or_direction_fails():
    sealer, _ = _pair(b"one connection")
    _, check = _pair(b"another connection")
    with pytest.raises(IntegrityError, match="the header's tag does not match"):
        _feed(_reader(check)[0], _frame(sealer, b"abc"), 1 << 16)
    send, receive = integrity.keys(b"k" * 32, b"t", True)
    assert send != receive  # each direction has its own key: a frame cannot be reflected back to its sender


def test_a_dropped_payload_is_checked_too():
    """A frame nobody receives (a collective this rank has finished) is read through the stage and dropped;
    its payload is still checked."""
    sealer, check = _pair()
    reader, box = _reader(check)
    box.on_mismatch = lambda error: None
    box.begin(0, 5)  # the frame's collective (seq 1) is over here
    bad = bytearray(_frame(sealer, os.urandom(3 * DIRECT_BYTES)))
    bad[HEAD + DIRECT_BYTES] ^= 0x80
    with pytest.raises(IntegrityError, match="the payload's tag does not match"):
        _feed(reader, bytes(bad), 5000)


def test_an_abort_names_the_link_on_the_ranks_it_reaches():
    error = IntegrityError("rank 0: integrity check failed on a frame from rank 1 over TCP a -> b", peer=1, rank=0)
    sealer, check = _pair()
    body = abort_body(error)
    box = Mailbox(2, JOB)
    reader = StreamReader(FrameInbox(2, 0, box), check)
    head, tail = sealer.seal(control(ABORT, JOB, nbytes=len(body)).pack(), memoryview(body))
    _feed(reader, head + body + tail, 1 << 16)  # type: ignore[operator]
    assert isinstance(box.aborted, IntegrityError) and box.aborted.peer == 1
    assert "rank 0 aborted the job" in str(box.aborted) and "over TCP a -> b" in str(box.aborted)


# ---- real jobs through a proxy that changes one byte ---------------------------------------------------------

def _inputs(step: int, rank: int, elements: int) -> np.ndarray:
    return np.random.default_rng(1000 * step + rank).standard_normal(elements).astype(np.float32)


def allreduces(pg, steps, elements=1 << 14):
    """Run ``steps`` allreduces (by default of 64 KiB of float32: one message each way on 2 ranks), each checked
    bit for bit against numpy; returns how many were right (a wrong one raises AssertionError, which the test
    reports as such)."""
    for step in range(steps):
        x = _inputs(step, pg.rank(), elements)
        pg.allreduce(x)
        assert np.array_equal(x, _inputs(step, 0, elements) + _inputs(step, 1, elements)), f"step {step}: wrong"
    return steps


@pytest.fixture
def flip_world(install_plugin, erdma_world):
    install_plugin("testflip", "testflip")

    def make(**flip):
        config = {"transport.tcp.local_sockets": False, "security.secret": "s3cret", "traversal.name": "flip",
                  "timeouts.collective": 60.0, **{f"traversal.flip.{k}": v for k, v in flip.items()}}
        return erdma_world(2, config, timeout=90)
    return make


@pytest.mark.parametrize("toward", ["listener", "dialler"])
@pytest.mark.parametrize("offset", [0, 9, 40, 63, 64, 75, 87, HEAD, HEAD + 30000, -17, -1])
def test_a_byte_flipped_on_the_path_fails_every_rank(flip_world, toward, offset):
    """Rank 1 dials rank 0 through the proxy; the byte flipped is in the 4th 64 KiB frame (header 0-63, seal
    64-87, payload, its tag the last 16 bytes), sent by rank 1 (toward the listener) or by rank 0."""
    world = flip_world(toward=toward, frame=3, offset=offset)
    outcomes = world.outcomes(allreduces, 10)
    _failed_everywhere(outcomes, toward)


@pytest.mark.parametrize("offset", [HEAD + integrity.PIECE + 7, -1])
def test_a_byte_flipped_in_a_payload_tagged_piece_by_piece_fails_every_rank(flip_world, offset):
    """A 4 MiB allreduce: its messages (2 MiB) are tagged piece by piece as they are written and read."""
    world = flip_world(frame=2, offset=offset, min_payload=integrity.PIECE + 1)
    _failed_everywhere(world.outcomes(allreduces, 4, 1 << 20), "listener")


def _failed_everywhere(outcomes: list[object], toward: str) -> None:
    sender, receiver = (1, 0) if toward == "listener" else (0, 1)
    for rank, err in enumerate(outcomes):
        assert isinstance(err, IntegrityError), f"rank {rank}: {err!r}"
        assert err.rank == rank and err.op == "allreduce" and err.peer == sender
        assert f"integrity check failed on a frame from rank {sender} over TCP 127.0.0.1:" in str(err)
    assert f"rank {receiver} aborted the job" in str(outcomes[sender])


def test_without_a_flip_the_proxy_changes_nothing(flip_world):
    world = flip_world(frame=1 << 30)
    assert world.run(allreduces, 10) == [10, 10]
