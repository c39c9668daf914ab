"""Single-copy transfers between ranks of one host (``transport/stream/single_copy.py``): the kernel call, the
set-up probe between two real processes, the mailbox's handling of lent messages (sans-IO, with a recording
``pull``) and whole jobs that lend, or do not, with results checked against numpy."""

from __future__ import annotations

import errno
import multiprocessing
import os
import socket
import time

import numpy as np
import pytest

from erdma_core.errors import MismatchError, PeerLostError, ProtocolError
from erdma_core.net.sockets import recv_exact
from erdma_core.transport.mailbox import Lent, Mailbox
from erdma_core.transport.request import Request
from erdma_core.transport.stream import single_copy
from erdma_core.wire import DATA, Header

pytestmark = pytest.mark.skipif(not single_copy.available(), reason="needs Linux process_vm_readv")
JOB = 0x5EC0DC0
TCP_ONLY = pytest.mark.skipif(os.environ.get("ERDMA_TRANSPORT", "tcp") != "tcp", reason="a TCP transport feature")


def hdr(seq: int = 1, dtype: int = 3, codec: int = 0) -> Header:
    """One float32 element of an allreduce(SUM)."""
    return Header(kind=DATA, job=JOB, dtype=dtype, opcode=1, redop=1, seq=seq, numel=1, count=1, nbytes=4, codec=codec)


# ---- the kernel call ------------------------------------------------------------------------------------
def test_read_copies_exactly_the_bytes_at_the_address():
    src = np.arange(1 << 18, dtype=np.uint32)
    out = bytearray(src.nbytes)
    single_copy.read(os.getpid(), single_copy.address_of(memoryview(src).cast("B")), memoryview(out))
    assert np.array_equal(np.frombuffer(out, np.uint32), src)
    ro = memoryview(b"read-only bytes!")
    seen = bytearray(len(ro))
    single_copy.read(os.getpid(), single_copy.address_of(ro), memoryview(seen))
    assert seen == ro


def test_read_of_memory_that_is_not_there_raises_efault():
    with pytest.raises(OSError) as info:
        single_copy.read(os.getpid(), 8, memoryview(bytearray(16)))
    assert info.value.errno == errno.EFAULT and "process_vm_readv" in str(info.value)


# ---- the set-up probe, between two processes ----------------------------------------------------------
def _probing_child(name: str, results: multiprocessing.Queue) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + name)
    lend, readable = single_copy.probe({0: sock}, time.monotonic() + 10)
    results.put((sorted(lend), readable, os.getppid()))


def _refusing_child(name: str) -> None:
    """A peer that offers memory that is not there and says it could not read the other's token."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + name)
    sock.sendall(single_copy._OFFER.pack(8, 16))
    recv_exact(sock, single_copy._OFFER.size)
    sock.sendall(bytes(16))
    recv_exact(sock, 16)


def _accept_one(child_target, *args) -> tuple[socket.socket, multiprocessing.Process, socket.socket]:
    name = f"erdma-test-probe-{os.getpid()}-{time.monotonic_ns()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)
    child = multiprocessing.get_context("fork").Process(target=child_target, args=(name, *args))
    child.start()
    listener.settimeout(10)
    conn, _ = listener.accept()
    return conn, child, listener


def test_probe_between_two_processes_finds_that_each_reads_the_other():
    results = multiprocessing.get_context("fork").Queue()
    conn, child, listener = _accept_one(_probing_child, results)
    try:
        lend, readable = single_copy.probe({1: conn}, time.monotonic() + 10)
        child_lend, child_readable, child_parent = results.get(timeout=10)
    finally:
        child.join(10)
        conn.close()
        listener.close()
    assert lend == {1} and readable == {1: child.pid}  # the pid the kernel saw connect, not a claimed one
    assert child_lend == [0] and child_readable == {0: child_parent}


def test_probe_lends_nothing_to_a_peer_that_cannot_read_and_reads_nothing_it_cannot():
    conn, child, listener = _accept_one(_refusing_child)
    try:
        lend, readable = single_copy.probe({1: conn}, time.monotonic() + 10)
    finally:
        child.join(10)
        conn.close()
        listener.close()
    assert lend == set() and readable == {}


def _silent_child(name: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + name)
    sock.close()  # gone before it answers


def test_probe_names_the_peer_that_stopped_answering():
    conn, child, listener = _accept_one(_silent_child)
    try:
        with pytest.raises(single_copy.Unanswered, match="rank 3 stopped answering") as info:
            single_copy.probe({3: conn}, time.monotonic() + 10)
    finally:
        child.join(10)
        conn.close()
        listener.close()
    assert info.value.peer == 3


# ---- the mailbox, sans-IO ------------------------------------------------------------------------------
class Puller:
    """A transport's ``pull``: copies from a dict standing for the peer's memory and records each call."""

    def __init__(self, memory: dict[int, bytes]) -> None:
        self.memory, self.calls = memory, []

    def __call__(self, peer, lent, out):
        self.calls.append((peer, lent.ticket, out is not None))
        if out is not None:
            out[:] = self.memory[lent.address]
        return None


def test_a_lent_message_is_read_into_a_receive_already_posted():
    pull = Puller({0x1000: b"abcd"})
    box, out = Mailbox(0, JOB, pull=pull), bytearray(4)
    req = box.post_recv(1, hdr(), memoryview(out))
    box.lent(1, hdr(), Lent(0x1000, 7))
    assert req.wait(1) and out == b"abcd" and pull.calls == [(1, 7, True)]


def test_an_early_lent_message_is_read_when_its_receive_is_posted_and_holds_no_memory_here():
    pull = Puller({0x1000: b"wxyz"})
    box, out = Mailbox(0, JOB, early_bytes=0, pull=pull), bytearray(4)
    box.lent(1, hdr(), Lent(0x1000, 3))  # early_bytes=0: a copied early frame would be refused
    assert pull.calls == []  # nothing read before there is somewhere to put it
    req = box.post_recv(1, hdr(), memoryview(out))
    assert req.wait(1) and out == b"wxyz" and pull.calls == [(1, 3, True)]


def test_a_lent_message_nobody_will_receive_is_given_back_unread():
    pull = Puller({})
    box = Mailbox(0, JOB, pull=pull)
    box.lent(1, hdr(seq=1), Lent(0x1000, 1))
    assert isinstance(box.begin(0, 2), MismatchError)  # seq 1 was never received here
    assert pull.calls == [(1, 1, False)]


def test_a_lent_message_that_disagrees_with_its_receive_fails_it_and_is_given_back():
    pull = Puller({})
    box, out = Mailbox(0, JOB, pull=pull), bytearray(4)
    box.lent(1, hdr(dtype=4), Lent(0x1000, 5))
    req = box.post_recv(1, hdr(), memoryview(out))
    with pytest.raises(MismatchError, match="allreduce mismatch between ranks 0 and 1"):
        req.wait(1)
    assert pull.calls == [(1, 5, False)] and out == bytes(4)


def test_a_failed_read_fails_the_receive():
    box, out = Mailbox(0, JOB, pull=lambda peer, lent, out: PeerLostError("cannot read it", peer=peer)), bytearray(4)
    req = box.post_recv(1, hdr(), memoryview(out))
    box.lent(1, hdr(), Lent(0x1000, 1))
    with pytest.raises(PeerLostError, match="cannot read it"):
        req.wait(1)


def test_lent_frames_are_refused_where_nothing_can_read_them():
    with pytest.raises(ProtocolError, match="rank 1 lent a message over a connection that cannot read it"):
        Mailbox(0, JOB).lent(1, hdr(), Lent(0x1000, 1))
    with pytest.raises(ProtocolError, match="lent an encoded message"):
        Mailbox(0, JOB, pull=Puller({})).lent(1, hdr(codec=9), Lent(0x1000, 1))


def test_a_lent_send_completes_when_given_back_and_fails_when_the_rank_aborts():
    box = Mailbox(0, JOB)
    done, pending = Request(), Request()
    t1 = box.lend(1, done, memoryview(b"x"))
    t2 = box.lend(2, pending, memoryview(b"y"))
    assert t1 != t2 and not done.done()
    box.returned(1, t1)
    assert done.wait(1)
    with pytest.raises(ProtocolError, match="gave back ticket 99, which was not lent to it"):
        box.returned(1, 99)
    box.abort(PeerLostError("rank 2 died", peer=2))
    with pytest.raises(PeerLostError, match="rank 2 died"):
        pending.wait(1)
    late = Request()
    assert box.lend(1, late, memoryview(b"z")) is None and late.done()


def test_a_lent_send_fails_when_its_peer_closes_or_its_connection_ends():
    box = Mailbox(0, JOB)
    a, b = Request(), Request()
    box.lend(1, a, memoryview(b"a"))
    box.lend(2, b, memoryview(b"b"))
    box.peer_gone(1, PeerLostError("rank 1 closed", peer=1))
    box.fail_lent(2, PeerLostError("rank 2 lost", peer=2))
    for req, needle in ((a, "rank 1 closed"), (b, "rank 2 lost")):
        with pytest.raises(PeerLostError, match=needle):
            req.wait(1)


# ---- whole jobs ------------------------------------------------------------------------------------------
def allreduce_and_count_lent(pg):
    x = (np.arange(1 << 20, dtype=np.float32) % 1000) * (pg.rank() + 1)  # 4 MiB
    expect = (np.arange(1 << 20, dtype=np.float32) % 1000) * sum(range(1, pg.size() + 1))
    before = pg.transport.mailbox._tickets
    pg.allreduce(x)
    y = np.full(1 << 19, pg.rank(), np.int64)
    pg.broadcast(y, 1)
    return bool(np.array_equal(x, expect)), bool((y == 1).all()), pg.transport.mailbox._tickets - before


@TCP_ONLY
@pytest.mark.parametrize("size", [2, 3])
def test_ranks_on_one_host_lend_large_messages_and_get_the_same_results(erdma_world, size):
    for same, bcast, lent in erdma_world(size).run(allreduce_and_count_lent):
        assert same and bcast
        assert lent > 0


@TCP_ONLY
@pytest.mark.parametrize("config", [{"transport.tcp.single_copy_bytes": 0}, {"transport.tcp.local_sockets": False}],
                         ids=["off", "over-tcp"])
def test_nothing_is_lent_when_single_copy_is_off_or_ranks_talk_over_tcp(erdma_world, config):
    for same, bcast, lent in erdma_world(2, config).run(allreduce_and_count_lent):
        assert same and bcast
        assert lent == 0


def lend_then_die(pg):
    big = np.ones(1 << 20, np.float32)
    if pg.rank() == 1:
        pg.send(big, 0, async_op=True)
        time.sleep(0.3)
        os._exit(0)
    time.sleep(1.0)  # its PULL has come; its process is gone before this receive reads it
    pg.recv(big, 1)


@TCP_ONLY
def test_a_sender_that_dies_before_its_lent_message_is_read_fails_the_receive_naming_it(erdma_world):
    outcomes = erdma_world(2, {"timeouts.collective": 20.0}, timeout=30).outcomes(lend_then_die)
    err = outcomes[0]
    assert isinstance(err, PeerLostError), err
    assert err.peer == 1 and "rank 1" in str(err)
