"""Attacks on a job, each refused and logged while the job beside it gets correct results: impersonation
without the secret, a replayed handshake, store writes without the secret, oversized length claims (store
requests and frames), idle connections during set-up, a second process claiming a rank."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import tracemalloc
import warnings

import numpy as np
import pytest

from erdma_core import AuthenticationError, ConfigError, ProtocolError
from erdma_core.cli.launcher import free_port
from erdma_core.discovery import FileStore, TCPStore
from erdma_core.discovery import store as store_mod
from erdma_core.net.sockets import recv_exact
from erdma_core.security import auth
from erdma_core.testing.world import World
from erdma_core.transport.mailbox import Mailbox
from erdma_core.wire import DATA, Header

SECRET = b"the job's secret"


@pytest.fixture
def served():
    """A TCP store served with SECRET, and a client of it."""
    store = TCPStore("127.0.0.1", 0, is_server=True, timeout=5.0, secret=SECRET)
    yield store
    store.close()


def _raw(store: TCPStore) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", store.port), timeout=5.0)
    return sock


def _prove(sock: socket.socket, secret: bytes) -> tuple[bytes, bytes]:
    """Run the client side of the store handshake by hand; returns (the bytes sent, the verdict byte)."""
    hs = auth.StoreClient(auth.store_key(secret), "test")
    first = hs.first()
    sock.sendall(first)
    challenge = recv_exact(sock, auth.NONCE + auth.MAC)
    try:
        proof = hs.on_challenge(challenge)
    except AuthenticationError:  # a wrong secret: answer with a guess anyway
        proof = bytes(auth.MAC)
    sock.sendall(proof)
    return first + proof, recv_exact(sock, 1)


# ---- the store -------------------------------------------------------------------------------------------


def test_store_refuses_a_client_without_the_secret(served, caplog):
    served.set("tcp/addr/0", b"127.0.0.1:1234")
    with pytest.raises(AuthenticationError, match="could not prove it knows the job's secret"):
        TCPStore("127.0.0.1", served.port, is_server=False, timeout=5.0, secret=b"a guess")
    with caplog.at_level(logging.WARNING, "erdma.discovery"), _raw(served) as sock:
        assert _prove(sock, b"a guess")[1] == b"\1"  # refused, then closed
        assert sock.recv(1) == b""
    assert "it could not prove the job's secret" in caplog.text
    assert served.get("tcp/addr/0", 1.0) == b"127.0.0.1:1234"


def test_store_ignores_requests_before_the_handshake(served, caplog):
    served.set("tcp/addr/0", b"127.0.0.1:1234")
    value = b"10.6.6.6:666"
    overwrite = struct.pack("<BdII", 1, 1.0, len(b"tcp/addr/0"), len(value)) + b"tcp/addr/0" + value
    with caplog.at_level(logging.WARNING, "erdma.discovery"), _raw(served) as sock:
        sock.sendall(overwrite)
        assert sock.recv(1024) == b""  # closed without an answer
    assert "bad store hello magic" in caplog.text
    assert served.get("tcp/addr/0", 1.0) == b"127.0.0.1:1234"


def test_store_refuses_a_replayed_handshake(served):
    with _raw(served) as sock:
        recorded, verdict = _prove(sock, SECRET)
        assert verdict == b"\0"
    with _raw(served) as sock:  # the same bytes against a fresh challenge
        sock.sendall(recorded[:auth.STORE_HELLO.size])
        recv_exact(sock, auth.NONCE + auth.MAC)
        sock.sendall(recorded[auth.STORE_HELLO.size:])
        assert recv_exact(sock, 1) == b"\1"


@pytest.mark.parametrize(("op", "timeout", "klen", "vlen", "message"), [
    (1, 1.0, 4, 0xFFFFFFFF, "store value of 4294967295 bytes exceeds"),
    (2, 1.0, 1 << 31, 0, "store key of 2147483648 bytes exceeds"),
    (3, 1.0, 4, 1 << 20, "store value of 1048576 bytes exceeds 32"),
    (2, float("nan"), 4, 0, "timeout nan is not in"),
    (2, 1e300, 4, 0, "timeout 1e+300 is not in"),
    (9, 1.0, 4, 0, "unknown store op 9"),
])
def test_store_bounds_a_request_before_reading_it(served, caplog, op, timeout, klen, vlen, message):
    with _raw(served) as sock:
        assert _prove(sock, SECRET)[1] == b"\0"
        tracemalloc.start()
        try:
            with caplog.at_level(logging.WARNING, "erdma.discovery"):
                sock.sendall(struct.pack("<BdII", op, timeout, klen, vlen) + b"k" * 4)
                assert sock.recv(16) == b""  # dropped, nothing allocated for the claim
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert message in caplog.text
    assert peak < 1 << 20
    served.set("still", b"serving")
    assert served.get("still", 1.0) == b"serving"


def test_idle_connections_do_not_keep_ranks_out_of_the_store(served, monkeypatch):
    monkeypatch.setattr(store_mod, "HANDSHAKE_S", 0.5)
    idle = [_raw(served) for _ in range(store_mod.MAX_UNPROVEN + 20)]  # more than the handshake slots
    try:
        client = TCPStore("127.0.0.1", served.port, is_server=False, timeout=10.0, secret=SECRET)
        client.set("k", b"v")
        assert served.get("k", 1.0) == b"v"
        client.close()
    finally:
        for sock in idle:
            sock.close()


# ---- the transport handshake -----------------------------------------------------------------------------


def _rank(rank: int, store, secret: bytes, results: dict, timeout: float = 10.0, job: int = 0x5EC,
          tls: bool = False) -> None:
    from erdma_core.plugins.builtin import TCP_OPTIONS
    from erdma_core.transport.base import TransportContext
    from erdma_core.transport.tcp import TcpTransport

    t = TcpTransport(None, {k: o.default for k, o in TCP_OPTIONS.items()} | {"local_sockets": False, "tls": tls})
    try:
        t.connect(TransportContext(rank=rank, world_size=2, store=store, job=job, connect_timeout=timeout,
                                   secret=secret))
        results[rank] = _exchange(t, rank)
    except Exception as exc:
        results[rank] = exc
    finally:
        t.close()


def _exchange(t, rank: int) -> np.ndarray:
    """One message each way through the connected transport; returns what arrived."""
    peer = 1 - rank
    out = np.full(1024, rank + 1, np.float32)
    got = np.zeros(1024, np.float32)
    h = Header(kind=DATA, job=t.job, dtype=1, opcode=1, group=0, seq=1, tag=0, numel=1024, count=1024,
               nbytes=4096)
    t.begin(0, 1)
    recv = t.irecv(peer, h, memoryview(got).cast("B"))
    send = t.isend(peer, h, memoryview(out).cast("B"), time.monotonic() + 5)
    assert t.wait(send, time.monotonic() + 5) and t.wait(recv, time.monotonic() + 5)
    return got


def _start(target, *args) -> threading.Thread:
    th = threading.Thread(target=target, args=args, daemon=True)
    th.start()
    return th


def _address(store: FileStore, rank: int) -> tuple[str, int]:
    host, port = store.get(f"tcp/addr/{rank}", 10.0).decode().rsplit(":", 1)
    return host, int(port)


def _dial_as(addr: tuple[str, int], secret: bytes, *, rank: int = 1, job: int = 0x5EC) -> None:
    """An outsider who read the store (job id, address) dials and claims to be ``rank``."""
    with socket.create_connection(addr, timeout=5.0) as sock:
        hs = auth.Dialling(auth.job_key(secret, job), job, rank, 0, 2)
        sock.sendall(hs.first())
        head = recv_exact(sock, auth.HELLO.size)
        proof = hs.on_challenge(head + recv_exact(sock, auth.MAC))
        assert proof is not None and hs.error is not None  # rank 0 did not prove anything to the outsider
        sock.sendall(proof)
        with pytest.raises(AuthenticationError, match="could not prove it knows the job's secret"):
            hs.on_verdict(recv_exact(sock, auth.HELLO.size))


def test_an_impersonator_is_refused_and_the_ranks_connect(tmp_path, caplog):
    store, results = FileStore(tmp_path), {}
    with caplog.at_level(logging.WARNING, "erdma.transport"):
        r0 = _start(_rank, 0, store, SECRET, results)
        addr = _address(store, 0)
        _dial_as(addr, b"a guess")  # knows the job id and the address, not the secret
        _dial_as(addr, b"")  # no secret at all
        r1 = _start(_rank, 1, store, SECRET, results)
        r0.join(20)
        r1.join(20)
    np.testing.assert_array_equal(results[0], np.full(1024, 2, np.float32))
    np.testing.assert_array_equal(results[1], np.full(1024, 1, np.float32))
    assert caplog.text.count("claimed rank 1: it could not prove the job's secret") == 2


def test_ranks_with_different_secrets_both_name_the_secret(tmp_path):
    store, results = FileStore(tmp_path), {}
    threads = [_start(_rank, 0, store, SECRET, results, 3.0), _start(_rank, 1, store, b"another", results, 3.0)]
    for th in threads:
        th.join(20)
    assert isinstance(results[1], AuthenticationError)
    assert "rank 0's address could not prove it knows the job's secret (security.secret differs" in str(results[1])
    assert "claimed rank 1: it could not prove the job's secret (a different security.secret?)" in str(results[0])


def test_a_replayed_hello_is_refused():
    key, job = auth.job_key(SECRET, 7), 7
    claim = lambda rank, lane, lanes: None  # noqa: E731
    first = auth.Accepting(key, job, 0, 2, range(1, 2), claim)
    dialler = auth.Dialling(key, job, 1, 0, 2)
    hello = dialler.first()
    proof = dialler.on_challenge(first.feed(hello))
    assert first.feed(proof)[:4] == auth.HELLO_MAGIC and first.rank_proven == 1
    again = auth.Accepting(key, job, 0, 2, range(1, 2), claim)  # the recorded bytes, a fresh challenge
    again.feed(hello)
    verdict = again.feed(proof)
    assert again.rank_proven is None and auth.parse_hello(verdict)[0] == auth.BAD_PROOF
    assert "could not prove the job's secret" in again.refused


def test_idle_connections_do_not_block_set_up(tmp_path, caplog, monkeypatch):
    from erdma_core.security import gate

    monkeypatch.setattr(gate, "HANDSHAKE_S", 600.0)  # they never expire: rank 1 gets in beside them
    store, results = FileStore(tmp_path), {}
    with caplog.at_level(logging.WARNING, "erdma.transport"):
        r0 = _start(_rank, 0, store, SECRET, results, 30.0)
        addr = _address(store, 0)
        idle = [socket.create_connection(addr) for _ in range(gate.MAX_PENDING + 8)]  # and say nothing
        slow = socket.create_connection(addr)
        slow.sendall(auth.pack_hello(auth.REQUEST, 0x5EC, 1, 2)[:10])  # a third of a HELLO, then nothing
        r1 = _start(_rank, 1, store, SECRET, results, 30.0)
        r0.join(40)
        r1.join(40)
    for sock in [*idle, slow]:
        sock.close()
    np.testing.assert_array_equal(results[0], np.full(1024, 2, np.float32))
    np.testing.assert_array_equal(results[1], np.full(1024, 1, np.float32))
    assert "stalled in its handshake; dropped for a newcomer" in caplog.text  # from its own address, too


def test_a_second_process_claiming_a_rank_is_refused(tmp_path):
    from erdma_core.api.join import _agree_job

    store = FileStore(tmp_path)
    job = _agree_job(store, 0, 2, SECRET, 5.0)
    assert _agree_job(store, 1, 2, SECRET, 5.0) == job
    with pytest.raises(ConfigError, match=r"another process already joined this job as rank 1 \(duplicate rank\)"):
        _agree_job(store, 1, 2, SECRET, 5.0)
    with pytest.raises(AuthenticationError, match=r"not signed with this rank's security\.secret"):
        _agree_job(FileStore(tmp_path), 1, 2, b"another", 5.0)
    with pytest.raises(ConfigError, match="world_size 3 disagrees with rank 0's 2"):
        _agree_job(store, 1, 3, SECRET, 5.0)


# ---- frames -------------------------------------------------------------------------------------------------


def test_a_frame_claiming_more_than_the_limit_allocates_nothing():
    box = Mailbox(0, 0x5EC, early_bytes=1 << 20)
    h = Header(kind=DATA, job=0x5EC, dtype=1, opcode=1, seq=1, numel=1, count=1, nbytes=1 << 40)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=r"rank 1 sent 1099511627776 bytes ahead of their receives .* "
                                                r"at most 1048576 are held \(security.max_early_bytes\)"):
            box.frame(1, h)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    small = h._replace(nbytes=600 << 10)
    box.frame(1, small)
    with pytest.raises(ProtocolError, match="1228800 bytes ahead"):  # the budget is per peer, summed
        box.frame(1, small._replace(tag=1))
    box.frame(2, small._replace(tag=1))  # another peer has its own


def big_early_send(pg, nbytes):
    if pg.rank() == 0:
        pg.send(np.ones(nbytes // 4, np.float32), dst=1)
        return "sent"
    time.sleep(1.0)  # the message arrives before the receive is posted
    out = np.zeros(nbytes // 4, np.float32)
    pg.recv(out, src=0)
    return float(out.sum())


def test_a_job_holds_early_messages_up_to_its_limit():
    # messages copied through the socket (a lent one, transport.tcp.single_copy_bytes, holds no memory here)
    with World(2, {"security.max_early_bytes": 1 << 20, "timeouts.collective": 10.0,
                   "transport.tcp.single_copy_bytes": 0}, timeout=60) as world:
        assert world.run(big_early_send, 1 << 19) == ["sent", float(1 << 17)]
        outcomes = world.outcomes(big_early_send, 2 << 20)
    assert isinstance(outcomes[1], Exception)
    assert "at most 1048576 are held (security.max_early_bytes)" in str(outcomes[1])


# ---- a whole job beside an attacker ---------------------------------------------------------------------------


def allreduce_ranks(pg):
    out = np.arange(4096, dtype=np.float32) * (pg.rank() + 1)
    pg.allreduce(out)
    return out


def _attack_store(port: int, stop: threading.Event, tries: list) -> None:
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
                tries.append(_prove(sock, b"a guess")[1])
        except (OSError, ConnectionError):
            pass
        time.sleep(0.01)


def test_a_job_beside_a_store_attacker_gets_correct_results(caplog):
    port = free_port()
    stop, tries = threading.Event(), []
    attacker = _start(_attack_store, port, stop, tries)
    try:
        with World(3, {"security.secret": SECRET.decode()}, init_method=f"tcp://127.0.0.1:{port}",
                   timeout=60) as world:
            results = world.run(allreduce_ranks)
    finally:
        stop.set()
        attacker.join(5)
    expected = np.arange(4096, dtype=np.float32) * 6
    for got in results:
        np.testing.assert_array_equal(got, expected)
    assert tries and set(tries) == {b"\1"}, "every handshake the attacker tried was refused"


def test_a_job_without_a_secret_warns_when_exposed():
    with pytest.warns(UserWarning, match="the job has no secret"):
        auth.warn_if_exposed("10.1.2.3", b"", "the test's listener")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auth.warn_if_exposed("127.0.0.1", b"", "a loopback listener")
        auth.warn_if_exposed("10.1.2.3", SECRET, "a listener with a secret")
    with pytest.raises(ConfigError, match=r"'security\.secret': empty, and security\.require_secret is true"):
        auth.require(b"", True)


def _init(rank: int, world: int, url: str, config: dict, results) -> None:
    import erdma_core

    try:
        erdma_core.init(config, rank=rank, world_size=world, init_method=url).destroy()
        results.put((rank, "joined"))
    except Exception as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("why", ["world", "secret"])
def test_a_rank_that_cannot_join_stops_the_others_set_up(tmp_path, why):
    """Rank 1 has another world size (or secret) than rank 0: both fail at once, rank 0 with rank 1's reason,
    not after the 30 s connect timeout."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    url = f"file://{tmp_path}/store"
    config = {"timeouts.connect": 30.0, "security.secret": "s"}
    other = {"world": (3, config), "secret": (2, {**config, "security.secret": "t"})}[why]
    procs = [ctx.Process(target=_init, args=(0, 2, url, config, results)),
             ctx.Process(target=_init, args=(1, other[0], url, other[1], results))]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=25) for _ in procs)
    for p in procs:
        p.join(10)
    reason = {"world": "world_size 3 disagrees with rank 0's 2",
              "secret": "not signed with this rank's security.secret"}[why]
    assert reason in got[1]
    assert got[0].startswith("ConfigError: rank 0: set-up stopped: rank 1: ") and reason in got[0]


def test_a_rank_whose_dialled_peer_is_stopped_still_hears_that_a_rank_gave_up(tmp_path):
    """Rank 0 is SIGSTOPped once it listens: rank 1's connection is taken by rank 0's kernel and its HELLO is
    never answered. A third rank's reason in the store (as a rank that cannot join writes it) still ends rank
    1's set-up at once, not at its 600 s connect timeout."""
    import multiprocessing as mp
    import os
    import signal

    from erdma_core.transport.base import failure_key

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    url = f"file://{tmp_path}/store"
    config = {"timeouts.connect": 600.0, "security.secret": "s"}
    store = FileStore(tmp_path / "store")
    zero = ctx.Process(target=_init, args=(0, 3, url, config, results))
    zero.start()
    try:
        store.get("tcp/addr/0", 60.0)
        os.kill(zero.pid, signal.SIGSTOP)
        one = ctx.Process(target=_init, args=(1, 3, url, config, results))
        one.start()
        job = int(store.get("erdma/job", 60.0).decode().split(":")[0])
        time.sleep(1.0)  # rank 1 dials rank 0 and waits for its answer
        assert one.is_alive()
        store.set(failure_key(job), b"rank 2: gave up for the test")
        got = results.get(timeout=30)
        one.join(10)
    finally:
        os.kill(zero.pid, signal.SIGKILL)
        zero.join(10)
    assert got == (1, "ConfigError: rank 1: set-up stopped: rank 2: gave up for the test"), got


# ---- TLS on the TCP path -------------------------------------------------------------------------------------


def tls_allreduce(pg):
    from erdma_core.transport.stream.tls import TlsSocket

    encrypted = all(isinstance(ch.sock, TlsSocket) for ch in pg.transport.channels.values())
    out = []
    for n in (1024, 3 << 20):  # one small frame; 12 MiB in 4 MiB chunks, written in parts
        a = np.arange(n, dtype=np.float32) * (pg.rank() + 1)
        pg.allreduce(a)
        out.append(a)
    return encrypted, out


def test_tls_carries_a_job_bit_for_bit():
    config = {"transport.tcp.tls": True, "transport.tcp.local_sockets": False, "security.secret": "s"}
    with World(3, config, timeout=60) as world:
        results = world.run(tls_allreduce)
    for encrypted, (small, big) in results:
        assert encrypted
        np.testing.assert_array_equal(small, np.arange(1024, dtype=np.float32) * 6)
        np.testing.assert_array_equal(big, np.arange(3 << 20, dtype=np.float32) * 6)


def _relay(listener: socket.socket, upstream: tuple[str, int], seen: list) -> None:
    """Someone on the path: forwards the authenticated handshake it cannot forge, then ends TLS on both
    sides with a certificate of its own, to read and change what follows."""
    import ssl

    from erdma_core.transport.stream import tls as tls_mod

    down, _ = listener.accept()
    up = socket.create_connection(upstream)
    for src, dst, n in ((down, up, auth.HELLO.size), (up, down, auth.HELLO.size + auth.MAC),
                        (down, up, auth.MAC), (up, down, auth.HELLO.size)):
        dst.sendall(recv_exact(src, n))
    server_ctx, client_ctx = tls_mod.make_contexts(tls_mod.make_identity())  # a certificate not rank 0's
    try:
        down_tls = server_ctx.wrap_socket(down, server_side=True)
        up_tls = client_ctx.wrap_socket(up)
        up_tls.sendall(recv_exact(down_tls, auth.MAC))  # the binding proofs, passed on
        down_tls.sendall(recv_exact(up_tls, auth.MAC))
        seen.append("in the middle")
    except (OSError, ConnectionError, ssl.SSLError) as exc:
        seen.append(exc)


def test_tls_refuses_a_relay_that_ends_it_on_both_sides(tmp_path):
    store, results, seen = FileStore(tmp_path), {}, []
    r0 = _start(_rank, 0, store, SECRET, results, 10.0, 0x5EC, True)
    real = _address(store, 0)
    listener = socket.create_server(("127.0.0.1", 0))
    relay = _start(_relay, listener, real, seen)
    store.set("tcp/addr/0", f"127.0.0.1:{listener.getsockname()[1]}".encode())  # the path now goes through it
    r1 = _start(_rank, 1, store, SECRET, results, 10.0, 0x5EC, True)
    for th in (r0, r1, relay):
        th.join(30)
    listener.close()
    assert seen == ["in the middle"]  # it did hold both TLS sessions ...
    assert isinstance(results[1], AuthenticationError) and "something in the middle" in str(results[1])
    # ... and rank 0 refused the connection (its proof did not match), so it still misses rank 1
    assert isinstance(results[0], Exception)


def test_small_whole_frames_held_early_count_against_the_limit_until_received():
    """Small frames a reader holds whole (``whole``) take the early path's shortcut: they still count
    against ``security.max_early_bytes`` per peer, and what a receive takes no longer counts."""
    box = Mailbox(0, 0x5EC, early_bytes=10 << 10)
    h = Header(kind=DATA, job=0x5EC, dtype=1, opcode=1, seq=1, numel=1024, count=1024, nbytes=4 << 10)
    box.whole(1, h, memoryview(bytes(range(256)) * 16))
    box.whole(1, h._replace(tag=1), memoryview(bytes(4 << 10)))
    with pytest.raises(ProtocolError, match=r"rank 1 sent 12288 bytes ahead of their receives .* at most 10240"):
        box.whole(1, h._replace(tag=2), memoryview(bytes(4 << 10)))
    box.whole(2, h._replace(tag=2), memoryview(bytes(4 << 10)))  # another peer has its own budget
    out = bytearray(4 << 10)
    req = box.post_recv(1, h, memoryview(out))
    assert req.done() and req.error is None and out == bytes(range(256)) * 16
    box.whole(1, h._replace(tag=2), memoryview(bytes(4 << 10)))  # the received one no longer counts
