"""Striping (``transport.quic.workers``): parts of large messages over worker processes' connections,
put back in place by the rank; a dead worker fails its rank's collectives and its peers', naming the lane."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from erdma_quic import parcels
from erdma_quic.streams import Inbound, message_parts, numbered
from helpers import MemoryStore, options, start

from erdma_core.sdk import AbortedError, ConfigError, ErdmaError, Header, PeerLostError, ProtocolError, TransportContext
from erdma_core.toolkit import BYE, DATA, FrameInbox, Mailbox

JOB = 91


def _header(seq: int, n: int, kind: int = DATA) -> Header:
    return Header(kind=kind, job=JOB, dtype=9, opcode=1, seq=seq, numel=n, count=n, nbytes=n)


class _Sink:
    def __init__(self) -> None:
        self.landed: list[tuple[bytes, bytes]] = []

    def open_part(self, peer: int, head: bytes, length: int) -> tuple[memoryview, object]:
        buf = bytearray(length)
        return memoryview(buf), (head, buf)

    def part_landed(self, token: object) -> None:
        head, buf = token  # type: ignore[misc]
        self.landed.append((head, bytes(buf)))


def test_parts_split_between_a_lane_and_the_main_connection_complete_the_frame_once():
    payload = np.random.default_rng(3).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    parts = message_parts(_header(0, len(payload)), payload, 3000)  # 4 parts
    box = Mailbox(0, JOB)
    sink = _Sink()
    main, lane = Inbound(1, FrameInbox(0, 1, box), lambda h: None), Inbound(1, None, lambda h: None, sink)
    out = np.zeros(len(payload), np.uint8)
    req = box.post_recv(1, _header(0, len(payload)), memoryview(out))
    for i, (head, body) in enumerate(parts):
        data = numbered(head, i // 2 + 1) + bytes(body)
        if i % 2:  # odd parts over the lane, fed in two slices
            lane.feed(4 * i, data[:100], fin=False)
            lane.feed(4 * i, data[100:], fin=True)
        else:
            main.feed(4 * i, data, fin=True)
    assert not req.done() and len(sink.landed) == 2
    for head, body in sink.landed:
        main.land(head, memoryview(body))
    assert req.done() and req.error is None and out.tobytes() == payload and main.completed == 1


def test_a_lane_refuses_control_frames_and_land_refuses_malformed_parts():
    lane = Inbound(1, None, lambda h: None, _Sink())
    (head, _), = message_parts(Header(kind=BYE, job=JOB, seq=3), b"", 4096)
    with pytest.raises(ProtocolError, match="rank 1 sent a control frame over a striping lane"):
        lane.feed(0, numbered(head, 1), fin=True)
    main = Inbound(1, FrameInbox(0, 1, Mailbox(0, JOB)), lambda h: None)
    (head, _), = message_parts(_header(0, 8), b"abcdefgh", 4096)
    with pytest.raises(ProtocolError, match=r"malformed part over a lane: kind 2/1, \[0, 8\) of 8 bytes, 3 received"):
        main.land(head, memoryview(b"abc"))


def _pair(**kw):
    store = MemoryStore()
    opts = options(secret="lanes", workers=2, part_bytes=65536, **kw)
    ranks = [start(r, 2, store, JOB, opts, timeout=30) for r in range(2)]
    for _, th, _ in ranks:
        th.join(40)
    assert [e for _, _, e in ranks] == [[], []]
    return [t for t, _, _ in ranks]


def _transfer(a, b, n: int, seq: int, rank_a: int = 0, rank_b: int = 1):
    src = np.random.default_rng(seq).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros_like(src)
    h = Header(kind=DATA, job=JOB, dtype=9, opcode=1, seq=seq, numel=n, count=n, nbytes=n)
    r = b.irecv(rank_a, h, memoryview(dst))
    s = a.isend(rank_b, h, memoryview(src), time.monotonic() + 30)
    return src, dst, s, r


def test_striped_messages_land_bit_exact_over_every_lane():
    t0, t1 = _pair()
    try:
        moves = [_transfer(t0, t1, 3 << 20, 1), _transfer(t1, t0, 3 << 20, 2, 1, 0),
                 _transfer(t0, t1, 1000, 3)]  # the small one stays on lane 0
        for src, dst, s, r in moves:
            assert s.wait(time.monotonic() + 30) and r.wait(time.monotonic() + 30)
            assert (src == dst).all()
        out0, in1 = t0.lane_stats()["parts_out"], t1.lane_stats()["parts_in"]
        assert out0[1] == out0[2] == 16 and in1[1:] == out0[1:]  # 48 parts of 64 KiB: 16 per lane
        assert t1.lane_stats()["parts_out"][1:] == [16, 16]
    finally:
        for t in (t0, t1):
            t.close()
    assert list(Path(parcels._DIR).glob(parcels.prefix(os.getpid()) + "*")) == []


def test_a_dead_worker_fails_both_ranks_naming_the_lane():
    t0, t1 = _pair(idle_timeout=5.0)
    try:
        worker = t1.lanes.workers[0]
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(5)
        _, _, s, r = _transfer(t0, t1, 1 << 20, 4)
        with pytest.raises(ErdmaError) as mine:
            r.wait(time.monotonic() + 15)
        assert isinstance(mine.value, ProtocolError)
        assert f"rank 1: QUIC lane 1 worker (pid {worker.proc.pid}) exited with code -9" in str(mine.value)
        with pytest.raises(ErdmaError) as theirs:
            s.wait(time.monotonic() + 15)
            t0.irecv(1, _header(5, 8), memoryview(bytearray(8))).wait(time.monotonic() + 15)
        # rank 1's ABORT usually comes first; rank 0's own lane 1 finds the port unreachable otherwise
        assert isinstance(theirs.value, (AbortedError, PeerLostError))
        assert "rank 1" in str(theirs.value) and "lane 1" in str(theirs.value)
    finally:
        for t in (t0, t1):
            t.close()


def test_workers_run_on_the_sockets_the_traversal_prepares_and_punch_from_them():
    """A traversal with ``udp_sockets``: every lane runs on a socket it prepared, advertised through it, and
    each lane punches towards the same lane of the ranks that dial it."""
    store, advertised, punched = MemoryStore(), {0: [], 1: []}, {0: [], 1: []}

    socks = {r: socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for r in range(2)}
    for s in socks.values():
        s.bind(("127.0.0.1", 0))
    lane_socks: dict[int, list[socket.socket]] = {0: [], 1: []}

    def ctx(rank: int) -> dict:
        def udp_sockets(count: int) -> list[socket.socket]:
            for _ in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.bind(("127.0.0.1", 0))
                lane_socks[rank].append(s)
            return lane_socks[rank]

        def advertise(host: str, port: int) -> tuple[str, int]:
            advertised[rank].append(port)
            return host, port

        def punch(host: str, port: int) -> bytes:
            punched[rank].append(port)
            return b"\x00punch"

        return {"udp_sockets": udp_sockets, "advertise": advertise, "punch": punch}

    opts = options(secret="lanes", workers=2, part_bytes=65536)
    ranks = [start(r, 2, store, JOB, opts, timeout=30, udp_socket=socks[r], **ctx(r)) for r in range(2)]
    for _, th, _ in ranks:
        th.join(40)
    assert [e for _, _, e in ranks] == [[], []]
    t0, t1 = (t for t, _, _ in ranks)
    try:
        src, dst, s, r = _transfer(t0, t1, 3 << 20, 1)
        assert s.wait(time.monotonic() + 30) and r.wait(time.monotonic() + 30) and np.array_equal(src, dst)
        assert sum(t0.lane_stats()["parts_out"][1:]) > 0
        for rank in range(2):  # lane 0 and both lanes advertised through the traversal, by their own ports
            assert advertised[rank] == [socks[rank].getsockname()[1]] + [s.getsockname()[1] for s in lane_socks[rank]]
        lane_ports_1 = [s.getsockname()[1] for s in lane_socks[1]]
        assert sorted(set(punched[0])) == sorted([socks[1].getsockname()[1], *lane_ports_1])  # rank 1 dials
        # rank 0 on every lane (lane 0's punch runs on a thread of its own: the order is not fixed; its datagram is
        # asked for again once the pair is up, for the mesh to send at each path check)
        assert punched[1] == []
    finally:
        for t in (t0, t1):
            t.close()


def test_workers_with_a_handed_over_socket_is_a_config_error():
    from erdma_quic.transport import QuicTransport

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    t = QuicTransport(None, options(secret="s", workers=2))
    with pytest.raises(ConfigError, match=r"transport.quic.workers = 2 .* valid here: 0"):
        t.connect(TransportContext(rank=0, world_size=2, store=MemoryStore(), job=JOB, connect_timeout=5.0,
                                   udp_socket=sock))
    sock.close()


def test_a_parcel_left_by_a_dead_process_with_the_same_pid_does_not_block_a_write():
    """pids are reused; a rank killed before it swept leaves parcels named after its pid and a counter that
    started at 0, as every process's does. The CI run that found this failed a send with FileExistsError."""
    stale = [Path(parcels._DIR) / f"{parcels.prefix(os.getpid())}out1-{os.getpid()}-{i}" for i in range(3)]
    for path in stale:
        path.write_bytes(b"old")
    names = []
    try:
        for _ in range(3):
            names.append(parcels.write(os.getpid(), "out1", memoryview(b"new")))
        assert len(set(names)) == 3 and all(bytes(parcels.take(n)) == b"new" for n in names)
        parent_nonce = parcels._name(os.getpid(), "x").split("-")[-2]
        child = os.fork()
        if child == 0:  # a forked child names its parcels apart from its parent's
            status = 1
            try:
                status = 0 if parcels._name(os.getpid(), "x").split("-")[-2] != parent_nonce else 2
            finally:
                os._exit(status)
        assert os.waitpid(child, 0)[1] == 0
    finally:
        parcels.sweep(os.getpid())


def killed_mid_striped_allreduce(pg):  # type: ignore[no-untyped-def]
    arr = np.ones(4 << 20, np.float32)  # 16 MiB: hundreds of parts through the worker, both ways
    if pg.rank() == 1:
        pg.allreduce(arr, async_op=True)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    pg.allreduce(arr)


def test_a_rank_killed_mid_transfer_leaves_no_parcels(erdma_world, quic_config):  # type: ignore[no-untyped-def]
    """Rank 1 is killed while parts of a striped allreduce move: its worker removes what was left for it, and
    rank 0 (which fails, naming rank 1) removes its own when it closes."""
    world = erdma_world(2, {**quic_config, "transport.quic.workers": 1, "transport.quic.part_bytes": 65536,
                            "timeouts.collective": 30.0}, timeout=60)
    pids = [p.pid for p in world.procs]
    outcomes = world.outcomes(killed_mid_striped_allreduce)
    assert "died" in outcomes[1] and isinstance(outcomes[0], PeerLostError), outcomes
    world.close()
    deadline = time.monotonic() + 30
    while left := [p for pid in pids for p in Path(parcels._DIR).glob(parcels.prefix(pid) + "*")]:
        assert time.monotonic() < deadline, left
        time.sleep(0.1)


def test_parcels_of_a_rank_that_no_longer_runs_are_swept(tmp_path):  # type: ignore[no-untyped-def]
    child = os.fork()
    if child == 0:
        parcels.write(os.getpid(), "out1", memoryview(b"left behind"))
        os._exit(0)  # no close, no sweep: as a SIGKILL would
    os.waitpid(child, 0)
    assert list(Path(parcels._DIR).glob(parcels.prefix(child) + "*"))
    mine = parcels.write(os.getpid(), "out1", memoryview(b"still mine"))
    assert parcels.sweep_dead() >= 1
    assert not list(Path(parcels._DIR).glob(parcels.prefix(child) + "*"))
    assert bytes(parcels.take(mine)) == b"still mine"  # a live rank's stay
