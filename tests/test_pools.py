"""Connection pools (``transport.tcp.connections``): a pair of ranks on TCP opens N connections and the
chunks of a message go side by side over them. Results are checked bit for bit against numpy, every
connection of the pool is seen carrying frames, frames that overtake each other still meet their receives
(point-to-point ones in the order they were sent), what a rank sent last arrives although each connection
closes on its own, and a pool of another size, or one a meeting traversal cannot make, is refused by name."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import types

import numpy as np
import pytest

from erdma_core.engine.program import chunk_bytes
from erdma_core.errors import AuthenticationError, ConfigError, PeerLostError
from erdma_core.security import auth
from erdma_core.transport.frames import FrameInbox, Pool
from erdma_core.transport.mailbox import Mailbox
from erdma_core.transport.tcp import TcpTransport
from erdma_core.wire import BYE, DATA, Header, control

TCP_ONLY = pytest.mark.skipif(os.environ.get("ERDMA_TRANSPORT", "tcp") != "tcp", reason="a TCP transport feature")
POOL = {"transport.tcp.connections": 4, "transport.tcp.local_sockets": False, "collectives.chunk_bytes": 1 << 17}


def _lane_frames(pg) -> dict[int, list[int]]:
    return {peer: [ch.frames for ch in lanes] for peer, lanes in pg.transport.lanes.items()}


def striped_allreduce(pg):
    n = 1 << 20  # 4 MiB of float32: 128 KiB chunks, dozens of them per peer
    x = ((np.arange(n, dtype=np.int64) * (pg.rank() + 1)) % 4096).astype(np.float32)
    want = sum(((np.arange(n, dtype=np.int64) * (k + 1)) % 4096) for k in range(pg.size())).astype(np.float32)
    pg.allreduce(x)
    return x.view(np.uint32).tobytes() == want.view(np.uint32).tobytes(), _lane_frames(pg)


@TCP_ONLY
@pytest.mark.parametrize(("size", "tls"), [(2, False), (4, False), (3, True)], ids=["2", "4", "3-tls"])
def test_a_pool_carries_the_chunks_on_every_connection_and_the_sums_are_exact(erdma_world, size, tls):
    """With TLS every connection of the pool has a session of its own, bound to its own handshake."""
    config = POOL | {"transport.tcp.tls": tls, "security.secret": "pool-test"}
    for rank, (exact, lanes) in enumerate(erdma_world(size, config).run(striped_allreduce)):
        assert exact, rank
        assert sorted(lanes) == [p for p in range(size) if p != rank]
        assert all(len(frames) == 4 for frames in lanes.values()), lanes
        sent_to = {peer: frames for peer, frames in lanes.items() if sum(frames)}  # the algorithm's peers
        assert sent_to and all(min(frames) > 0 for frames in sent_to.values()), (rank, lanes)


def test_messages_are_cut_finer_for_a_pool_so_that_every_connection_carries_a_chunk():
    assert chunk_bytes(4 << 20, 1) == 4 << 20
    assert chunk_bytes(4 << 20, 8) == 512 << 10
    assert chunk_bytes(4 << 20, 64) == 256 << 10  # not below the floor
    assert chunk_bytes(64 << 10, 8) == 64 << 10  # nor above what was asked for


def chunked_for_the_pool(pg):
    return pg.transport.stripes, pg.runner.chunk_bytes


@TCP_ONLY
def test_a_pool_of_four_cuts_the_default_chunks_in_four(erdma_world):
    config = {"transport.tcp.connections": 4, "transport.tcp.local_sockets": False}
    assert erdma_world(2, config).run(chunked_for_the_pool) == [(4, 1 << 20)] * 2


def in_order(pg):
    """Twelve sends of 256 KiB with one tag, to the pool's four connections: received in the order sent."""
    if pg.rank() == 1:
        works = [pg.isend(np.full(1 << 16, i, np.float32), 0, tag=7) for i in range(12)]
        for w in works:
            w.wait()
        return _lane_frames(pg)[0]
    got = []
    for _ in range(12):
        buf = np.empty(1 << 16, np.float32)
        pg.recv(buf, 1, tag=7)
        got.append(float(buf[0]) if (buf == buf[0]).all() else -1.0)
    return got


@TCP_ONLY
def test_sends_with_one_tag_spread_over_the_pool_are_received_in_the_order_sent(erdma_world):
    got, frames = erdma_world(2, POOL).run(in_order)
    assert got == [float(i) for i in range(12)]
    assert sum(frames) >= 12 and min(frames) > 0, frames


def last_words(pg):
    """Rank 1 sends last and closes at once; rank 0 takes it a moment later, after rank 1's first
    connections have already ended."""
    big = np.arange(1 << 18, dtype=np.float32) * (pg.rank() + 1)
    if pg.rank() == 1:
        for _ in range(4):
            pg.send(big, 0)
        return True
    time.sleep(1.0)
    ok = True
    for _ in range(4):
        buf = np.empty_like(big)
        pg.recv(buf, 1)
        ok &= bool(np.array_equal(buf, np.arange(1 << 18, dtype=np.float32) * 2))
    return ok


@TCP_ONLY
def test_what_a_rank_sent_last_over_a_pool_arrives_after_it_closed(erdma_world):
    assert erdma_world(2, POOL).run(last_words) == [True, True]


def test_a_peer_is_gone_only_once_every_connection_of_its_pool_has_closed():
    """One connection's BYE (nothing came on it) while a frame is still on its way on the other: the
    receive posted for that frame completes with its bytes, and only the last BYE marks the peer gone."""
    job = 0x5EC
    box = Mailbox(0, job)
    first, second = FrameInbox(0, 1, box), FrameInbox(0, 1, box)
    Pool([first, second])
    first.whole(control(BYE, job, seq=0), memoryview(b""))
    assert first.closed_cleanly and not second.closed_cleanly
    meta = Header(kind=DATA, job=job, dtype=3, opcode=1, redop=1, seq=1, numel=1, count=1, nbytes=4)
    out = bytearray(4)
    req = box.post_recv(1, meta, memoryview(out))
    assert not req.done()  # not failed: the peer's other connection is still open
    second.whole(meta, memoryview(b"\x01\x02\x03\x04"))
    assert req.wait(1) and out == b"\x01\x02\x03\x04"
    second.whole(control(BYE, job, seq=1), memoryview(b""))
    late = box.post_recv(1, meta._replace(seq=2), memoryview(bytearray(4)))
    with pytest.raises(PeerLostError, match="rank 1 closed its process group"):
        late.wait(1)


def _init(rank: int, url: str, connections: int, out: mp.Queue) -> None:
    import erdma_core

    try:
        pg = erdma_core.init({"transport.tcp.connections": connections, "transport.tcp.local_sockets": False,
                              "timeouts.connect": 10.0}, rank=rank, world_size=2, init_method=url)
        pg.destroy()
        out.put((rank, "connected"))
    except Exception as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}"))


@TCP_ONLY
def test_ranks_whose_pools_differ_are_told_which_setting_differs(tmp_path):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_init, args=(r, f"file://{tmp_path}/store", 2 if r == 0 else 1, out), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    said = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    assert said[1].startswith("AuthenticationError: rank 1: rank 0 refused the connection: it opens another "
                              "number of connections per pair of ranks (transport.tcp.connections differs)"), said
    assert "transport.tcp.connections differs" in said[0], said


def test_the_handshake_carries_the_pool_and_binds_it():
    key = auth.job_key(b"secret", 7)
    seen = []

    def claim(rank: int, lane: int, lanes: int) -> int | None:
        seen.append((rank, lane, lanes))
        return None if lanes == 4 else auth.WRONG_LANES

    for lane, lanes, accepted in ((3, 4, True), (0, 2, False)):
        acceptor = auth.Accepting(key, 7, 0, 2, range(1, 2), claim)
        dialler = auth.Dialling(key, 7, 1, 0, 2, lane=lane, lanes=lanes)
        proof = dialler.on_challenge(acceptor.feed(dialler.first()))
        verdict = acceptor.feed(proof)
        if accepted:
            dialler.on_verdict(verdict)
            assert acceptor.rank_proven == 1 and dialler.transcript == acceptor.transcript
        else:
            with pytest.raises(AuthenticationError, match=r"transport\.tcp\.connections differs"):
                dialler.on_verdict(verdict)
    assert seen == [(1, 3, 4), (1, 0, 2)]
    # a proof made for one connection of the pool does not pass for another: lane and pool size are in it
    one, other = auth.Dialling(key, 7, 1, 0, 2, lane=1, lanes=4), auth.Accepting(key, 7, 0, 2, range(1, 2), claim)
    hello = bytearray(one.first())
    other_reply = other.feed(bytes(hello))
    hello[28:30] = (2).to_bytes(2, "little")  # the same dialler, claiming lane 2 to a fresh acceptor
    third = auth.Accepting(key, 7, 0, 2, range(1, 2), claim)
    third.feed(bytes(hello))
    proof = one.on_challenge(other_reply)
    assert third.feed(proof)[:4] == auth.HELLO_MAGIC and third.rank_proven is None and "secret" in third.refused
    with pytest.raises(ValueError, match="at most 64 connections"):
        auth.Dialling(key, 7, 1, 0, 2, lane=0, lanes=65)


def test_a_traversal_that_meets_peers_refuses_a_pool():
    section = {"single_copy_bytes": 0, "local_sockets": False, "spin_us": 0, "tls": False, "connections": 3,
               "port": 0, "bind_address": "", "interface": "", "congestion": "auto"}
    transport = TcpTransport(None, section)
    with socket.socket() as sock:
        ctx = types.SimpleNamespace(tcp_socket=lambda: sock)
        with pytest.raises(ConfigError, match=r"'transport\.tcp\.connections': value 3 cannot take effect"):
            transport.meeting_point(ctx)  # type: ignore[arg-type]
