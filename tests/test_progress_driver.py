"""The socket driver on its own (``transport/stream/progress.py``), over a socket pair: frames written at once or
finished by a waiting thread, byte for byte and in order; ``spin`` decides how long a waiter polls before it
sleeps."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from erdma_core.errors import PeerLostError
from erdma_core.transport.frames import FrameInbox, StreamReader
from erdma_core.transport.mailbox import Mailbox
from erdma_core.transport.request import Request
from erdma_core.transport.stream.progress import Channel, Progress


def driver(spin: float) -> tuple[Progress, socket.socket]:
    mine, theirs = socket.socketpair()
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    ch = Channel(1, mine, StreamReader(FrameInbox(0, 1, Mailbox(0, 7))))
    return Progress([ch], lambda peer, why, cleanly: None, lambda error: None, "test-io", spin), theirs


def rounds(progress: Progress) -> list[float]:
    """The poll timeouts (ms) of the driver's rounds while it waits 0.2 s for a request that never completes."""
    seen: list[float] = []
    inner = progress._round

    def spy(timeout_ms: float, req: Request | None) -> bool:
        seen.append(timeout_ms)
        return inner(timeout_ms, req)

    progress._round = spy  # type: ignore[method-assign]
    assert progress.wait(Request(), time.monotonic() + 0.2) is False
    return seen


def test_a_waiter_polls_without_sleeping_only_for_its_spin():
    for spin in (0.0, 0.05):
        progress, theirs = driver(spin)
        try:
            seen = rounds(progress)
        finally:
            progress.stop()
            theirs.close()
        polls = [t for t in seen if t == 0]
        if spin == 0:
            assert polls == [] and seen and seen[0] > 0, seen
        else:
            # it polled, then slept in poll: first the zero timeouts, then only sleeping rounds
            assert len(polls) >= 2 and seen[:len(polls)] == polls and all(t > 0 for t in seen[len(polls):]), seen


def test_frames_too_big_for_the_socket_are_finished_by_the_waiter_in_order():
    progress, theirs = driver(0.0)
    ch = progress.channels[0]
    heads = [bytes([i]) * 60 for i in range(3)]
    payloads = [np.arange(n, dtype=np.uint8) for n in (100, 3 << 20, 5 << 20)]
    got = bytearray()
    total = sum(len(h) + p.nbytes for h, p in zip(heads, payloads, strict=True))

    theirs.settimeout(30)

    def read() -> None:
        while len(got) < total:
            chunk = theirs.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    try:
        reqs = [Request() for _ in heads]
        for h, p, r in zip(heads, payloads, reqs, strict=True):
            progress.send(ch, (h, memoryview(p)), r)
        assert reqs[0].done()  # a small frame on an empty queue is written at once
        assert not reqs[2].done()  # 8 MiB do not fit the socket's buffers while nobody reads: queued
        reader.start()
        for r in reqs:
            assert progress.wait(r, time.monotonic() + 30)
        reader.join(30)
        assert not reader.is_alive()
    finally:
        progress.stop()
        theirs.close()
    assert bytes(got) == b"".join(h + p.tobytes() for h, p in zip(heads, payloads, strict=True))


def test_a_send_that_fails_at_once_fails_its_request():
    """The posting thread's own write finds the peer gone (EPIPE): the request fails with PeerLostError at
    once. (It was left pending, so the collective waited out its whole timeout: seen as a rank that did not
    answer in 1 of 4 runs of the SIGKILL test on three ranks.)"""
    from erdma_core.errors import PeerLostError

    progress, theirs = driver(0.0)
    ch = progress.channels[0]
    theirs.shutdown(socket.SHUT_RD)  # writing to it fails; nothing to read, so no other thread sees it end first
    req = Request()
    try:
        progress.send(ch, (b"h" * 60, memoryview(np.zeros(100, np.uint8))), req)
        assert req.done() and isinstance(req.error, PeerLostError), req.error
        assert "rank 1's connection closed: sending failed" in str(req.error)
        later = Request()
        progress.send(ch, (b"h" * 60, memoryview(np.zeros(100, np.uint8))), later)
        assert later.done() and isinstance(later.error, PeerLostError)
    finally:
        progress.stop()
        theirs.close()


def test_a_send_that_fails_after_another_thread_ended_the_channel_gets_that_threads_reason():
    """The race of a flaky abort test: a reader hears the peer's ABORT and then its close, and ends the channel
    with the reason the peer gave; a send on another thread, written before that and failing after it (broken
    pipe), must fail with that same reason, not its own socket error."""
    told = PeerLostError("rank 1 aborted the job", peer=1)
    mine, theirs = socket.socketpair()
    ch = Channel(1, mine, StreamReader(FrameInbox(0, 1, Mailbox(0, 7))))
    progress = Progress([ch], lambda peer, why, cleanly: told, lambda error: None, "test-io", 0.0)
    try:
        progress._end(ch, "it closed the connection", True)  # the reader's turn, first
        late = progress._end(ch, "sending failed: [Errno 32] Broken pipe")  # the sender's, after it
        req = Request()
        progress.send(ch, [memoryview(b"x" * 64)], req)  # and a send posted once the channel is dead
        assert late is told and req.error is told
    finally:
        progress.stop()
        theirs.close()
