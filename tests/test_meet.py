"""The built-in TCP transport on a socket its traversal prepared (``Traversal.tcp_socket``): every pair of ranks
meets from those ports, both connecting at once (``erdma_core.net.meet``), with the job's handshake
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
from erdma_core.net import meet
from erdma_core.net.addresses import Candidate
from erdma_core.plugins.builtin import TCP_OPTIONS
from erdma_core.transport.base import TransportContext
from erdma_core.transport.tcp import TcpTransport
from erdma_core.wire import DATA, Header

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


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair()


def test_a_connection_from_an_unpublished_port_is_a_lower_ranks_meeting_only_when_its_host_is_that_ranks_alone():
    """A NAT that maps each destination anew sends a lower rank's SYN from a port it never published: the listener
    gives it to that rank's meeting by host, as a peer-reflexive candidate, only once every peer's candidates are
    known and no other peer is published at that host; otherwise the acceptor takes it (as before)."""
    arrivals = meet.Arrivals(peers=3)
    arrivals.expect(0, [Candidate("10.0.0.5", 4000), Candidate("203.0.113.7", 4000, "srflx")])
    arrivals.expect(1, [Candidate("10.0.1.5", 4000), Candidate("203.0.113.8", 4000, "srflx")])
    a, b = _pair()
    assert not arrivals.divert(a, ("203.0.113.7", 51234))  # rank 3 not known yet: it may be there too
    arrivals.known(3, [Candidate("198.51.100.9", 4000), Candidate("203.0.113.9", 7000, "relay")])
    assert not arrivals.divert(a, ("192.0.2.1", 51234))  # nobody's host
    assert arrivals.divert(a, ("203.0.113.7", 51234))
    got = arrivals.take(0)
    assert got is not None and got[1] == Candidate("203.0.113.7", 51234, "prflx")
    assert arrivals.take(0) is None
    assert arrivals.divert(b, ("203.0.113.8", 4000))  # a published port: that rank's, as before
    assert arrivals.take(1) == (b, Candidate("203.0.113.8", 4000, "srflx"))
    c, d = _pair()
    assert not arrivals.divert(c, ("203.0.113.9", 50000))  # rank 3 is higher (it dials), and only its relay is there
    assert not arrivals.divert(c, ("198.51.100.9", 50000))  # a higher rank's host: the acceptor's
    for s in (a, b, c, d):
        s.close()


def test_peers_on_one_host_leave_every_unpublished_port_to_the_acceptor():
    """Ranks on one machine (or behind one NAT): a host names several peers, so nothing is guessed; a higher rank
    dialling from its published port is the acceptor's too (it is not a lower rank's)."""
    arrivals = meet.Arrivals(peers=2)
    arrivals.expect(0, [Candidate("127.0.0.1", 4000, "srflx")])
    a, b = _pair()
    assert not arrivals.divert(a, ("127.0.0.1", 4100))  # rank 2 not known yet
    arrivals.known(2, [Candidate("127.0.0.1", 4100, "srflx")])
    assert not arrivals.divert(a, ("127.0.0.1", 4100))  # rank 2's own address: it dials, the acceptor proves it
    assert not arrivals.divert(a, ("127.0.0.1", 51234))  # rank 0's, or rank 2's: not guessed
    assert arrivals.divert(a, ("127.0.0.1", 4000))
    assert arrivals.take(0) == (a, Candidate("127.0.0.1", 4000, "srflx"))
    a.close()
    b.close()
