"""The built-in TCP transport on a socket its traversal prepared (``Traversal.tcp_socket``): every pair of ranks
meets from those ports, both connecting at once (``erdma_core.transport.meet``), with the job's handshake
deciding roles by rank; what each rank reports as its paths; settings that cannot take effect are refused.
Through real NATs: plugins/erdma-p2p/tests/test_nat.py."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from erdma_core import ConfigError
from erdma_core.discovery import FileStore
from erdma_core.plugins.builtin import TCP_OPTIONS
from erdma_core.transport import meet
from erdma_core.transport.addresses import Candidate
from erdma_core.transport.base import TransportContext
from erdma_core.transport.tcp import TcpTransport
from erdma_core.transport.wire import DATA, Header

SECRET = b"meet-test-secret"


class LoopbackTraversal:
    """A traversal with no NAT in the way: its TCP socket on 127.0.0.1, published as it is."""

    def __init__(self) -> None:
        self.port = 0

    def tcp_socket(self) -> socket.socket:
        sock = meet.bound_to(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        return sock

    def candidates(self, host: str, port: int) -> list[Candidate]:
        assert port == self.port
        return [Candidate("127.0.0.1", port, "srflx")]

    def advertise(self, host: str, port: int) -> tuple[str, int]:
        return "127.0.0.1", port


def _transport(**opts: object) -> TcpTransport:
    return TcpTransport(None, {k: o.default for k, o in TCP_OPTIONS.items()} | {"local_sockets": False, **opts})


def _ranks(tmp_path, world: int, **opts: object) -> tuple[list, list[LoopbackTraversal]]:
    """Connect ``world`` TCP transports, each meeting from its traversal's port; each rank's transport or error."""
    traversals = [LoopbackTraversal() for _ in range(world)]
    out: list = [None] * world

    def run(rank: int) -> None:
        t = _transport(**opts)
        tr = traversals[rank]
        try:
            t.connect(TransportContext(rank=rank, world_size=world, store=FileStore(str(tmp_path / "store")), job=7,
                                       connect_timeout=10.0, secret=SECRET, tcp_socket=tr.tcp_socket,
                                       candidates=tr.candidates, advertise=tr.advertise))
            out[rank] = t
        except Exception as exc:
            out[rank] = exc
            t.close()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return out, traversals


def _ring_exchange(ts: list[TcpTransport]) -> list[np.ndarray]:
    """Each rank sends its values to the next and receives the previous one's; what each received."""
    world = len(ts)
    got = [np.zeros(4096, np.float32) for _ in ts]
    reqs = []
    for r, t in enumerate(ts):
        h = Header(kind=DATA, job=t.job, dtype=1, opcode=1, group=0, seq=1, tag=0, numel=4096, count=4096,
                   nbytes=4 * 4096)
        t.begin(0, 1)
        reqs.append((t, t.irecv((r - 1) % world, h, memoryview(got[r]).cast("B"))))
        out = np.arange(4096, dtype=np.float32) * (r + 1)
        reqs.append((t, t.isend((r + 1) % world, h, memoryview(out).cast("B"), time.monotonic() + 10)))
    for t, req in reqs:
        assert t.wait(req, time.monotonic() + 10)
    return got


@pytest.mark.parametrize("world, tls", [(2, False), (4, False), (3, True)])
def test_ranks_meet_from_the_ports_their_traversal_prepared(tmp_path, world, tls):
    ts, traversals = _ranks(tmp_path, world, tls=tls)
    try:
        assert all(isinstance(t, TcpTransport) for t in ts), ts
        got = _ring_exchange(ts)
        for r in range(world):
            assert np.array_equal(got[r], np.arange(4096, dtype=np.float32) * ((r - 1) % world + 1))
        for r, t in enumerate(ts):  # every connection runs between the two meeting ports
            assert t.paths() == {p: f"127.0.0.1:{traversals[p].port} direct" for p in range(world) if p != r}
            for p, ch in t.channels.items():
                sock = getattr(ch.sock, "tls", ch.sock)  # under TLS, the SSL socket
                assert sock.getsockname()[1] == traversals[r].port
                assert sock.getpeername()[1] == traversals[p].port
    finally:
        for t in ts:
            if isinstance(t, TcpTransport):
                t.close()


def test_each_rank_publishes_its_paths_for_the_doctor(tmp_path):
    ts, traversals = _ranks(tmp_path, 2)
    try:
        store = FileStore(str(tmp_path / "store"))
        assert store.get("paths/0", 1.0).decode() == f"1 127.0.0.1:{traversals[1].port} direct"
        assert store.get("paths/1", 1.0).decode() == f"0 127.0.0.1:{traversals[0].port} direct"
    finally:
        for t in ts:
            if isinstance(t, TcpTransport):
                t.close()


def test_a_connection_from_elsewhere_must_prove_the_secret(tmp_path):
    """The meeting port listens (where no NAT filters, a peer's SYN lands there); a stranger that connects
    to it meets the job's handshake, is refused, and the ranks still meet."""
    traversal = LoopbackTraversal()
    sock = traversal.tcp_socket()
    port = sock.getsockname()[1]
    sock.close()

    class Watched(LoopbackTraversal):
        def tcp_socket(self) -> socket.socket:
            s = meet.bound_to(("127.0.0.1", port))
            self.port = port
            return s

    store = FileStore(str(tmp_path / "store"))
    results: dict[int, object] = {}

    def rank0() -> None:
        t = _transport()
        tr = Watched()
        try:
            t.connect(TransportContext(rank=0, world_size=2, store=store, job=7, connect_timeout=10.0, secret=SECRET,
                                       tcp_socket=tr.tcp_socket, candidates=tr.candidates, advertise=tr.advertise))
            results[0] = t
        except Exception as exc:
            results[0] = exc

    th = threading.Thread(target=rank0, daemon=True)
    th.start()
    store.get("tcp/addr/0", 10.0)  # rank 0 listens at its meeting port now
    stranger = socket.create_connection(("127.0.0.1", port), timeout=5)
    stranger.sendall(b"\0" * 64)  # not a HELLO
    stranger.settimeout(5)
    try:
        assert stranger.recv(64) == b""  # dropped
    except ConnectionResetError:  # dropped with what it sent unread
        pass
    stranger.close()
    tr1 = LoopbackTraversal()
    t1 = _transport()
    try:
        t1.connect(TransportContext(rank=1, world_size=2, store=FileStore(str(tmp_path / "store")), job=7,
                                    connect_timeout=10.0, secret=SECRET, tcp_socket=tr1.tcp_socket,
                                    candidates=tr1.candidates, advertise=tr1.advertise))
        th.join(15)
        assert isinstance(results[0], TcpTransport), results
        assert _ring_exchange([results[0], t1])[0][1] == 2.0  # rank 1's values (x2) arrived at rank 0
    finally:
        t1.close()
        if isinstance(results.get(0), TcpTransport):
            results[0].close()


@pytest.mark.parametrize("key, value", [("port", 4000), ("bind_address", "127.0.0.1"), ("interface", "lo")])
def test_a_listening_address_the_traversal_overrides_is_refused(tmp_path, key, value):
    tr = LoopbackTraversal()
    t = _transport(**{key: value})
    with pytest.raises(ConfigError, match=f"config key 'transport.tcp.{key}': value {value!r} is not used when the "
                                          "traversal prepares"):
        t.connect(TransportContext(rank=0, world_size=1, store=FileStore(str(tmp_path / "store")), job=7,
                                   connect_timeout=2.0, secret=SECRET, tcp_socket=tr.tcp_socket,
                                   candidates=tr.candidates))
    t.close()
