"""The compiled engine (ngtcp2 behind erdma_quic/ngtcp2's C shim) on its own: two connections handed each
other's datagrams in memory (loss and reordering chosen by the test, time moved by the test), and two on real
UDP sockets over loopback with the batch I/O. Mutual TLS with the job's CA as erdma-quic sets it up."""

from __future__ import annotations

import importlib
import os
import random
import select
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from erdma_quic import credentials

from erdma_core.sdk import PluginError

HAVE_NGTCP2 = shutil.which("pkg-config") is not None and subprocess.run(
    ["pkg-config", "--exists", "libngtcp2", "libngtcp2_crypto_gnutls", "gnutls"], check=False).returncode == 0
pytestmark = pytest.mark.skipif(not HAVE_NGTCP2, reason="no ngtcp2 here (apt-get install libngtcp2-dev "
                                "libngtcp2-crypto-gnutls-dev libgnutls28-dev pkg-config)")
JOB = 0x5EED

from erdma_quic.ngtcp2.connection import (  # noqa: E402
    Acked,
    Closed,
    Config,
    Connection,
    Demux,
    Handshaken,
    Head,
    Message,
    Placed,
    Run,
    Ticket,
    Tickets,
)


def config(ca: credentials.Authority, rank: int, trust: credentials.Authority | None = None, **kw: object) -> Config:
    mine = credentials.issue(ca, rank, JOB)
    key = mine.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    return Config(cert_pem=mine.cert.public_bytes(serialization.Encoding.PEM), key_pem=key,
                  ca_pem=(trust or ca).pem, **kw)  # type: ignore[arg-type]


class Wire:
    """Two connections and the datagrams between them: ``loss`` of them dropped, the rest shuffled per turn."""

    def __init__(self, dialler: Config, listener: Config, loss: float = 0.0, seed: int = 1,
                 early: tuple[bytes, ...] = ()) -> None:
        """``early``: messages the dialler sends before its first flight (0-RTT data when it resumes)."""
        self.now, self.loss, self.rng = 1.0, loss, random.Random(seed)
        self.a = Connection.dial(dialler, ("10.0.0.1", 1000), ("10.0.0.2", 2000), self.now)
        for message in early:
            self.a.send(message)
        self.first = self.a.datagrams_to_send(self.now)
        self.b = Connection.accept(listener, ("10.0.0.2", 2000), ("10.0.0.1", 1000), self.first[0], self.now)
        self.b.receive(self.first[1:], self.now)
        self.events: dict[str, list[object]] = {"a": [], "b": []}
        self.dark = False

    def carry(self, datagrams: list[bytes]) -> list[bytes]:
        if self.dark:
            return []
        kept = [d for d in datagrams if self.rng.random() >= self.loss]
        self.rng.shuffle(kept)
        return kept

    def turn(self, step: float = 0.001) -> None:
        self.now += step
        for conn in (self.a, self.b):
            due = conn.get_timer()
            if due is not None and due <= self.now:
                conn.handle_timer(self.now)
        self.b.receive(self.carry(self.a.datagrams_to_send(self.now)), self.now)
        self.a.receive(self.carry(self.b.datagrams_to_send(self.now)), self.now)
        for name, conn in (("a", self.a), ("b", self.b)):
            while (ev := conn.next_event()) is not None:
                self.events[name].append(ev)

    def until(self, done: object, turns: int = 200_000, step: float = 0.001) -> None:
        for _ in range(turns):
            if done():  # type: ignore[operator]
                return
            self.turn(step)
        raise AssertionError(f"not done after {turns} turns: {self.events}")

    def of(self, name: str, kind: type) -> list[object]:
        return [e for e in self.events[name] if isinstance(e, kind)]


def test_shim_is_built_where_ngtcp2_is_installed() -> None:
    importlib.import_module("erdma_quic.ngtcp2._shim")


@pytest.mark.parametrize("cc", ["bbr2", "cubic"])
def test_whole_messages_arrive_once_and_bit_exact_through_loss_and_reordering(cc: str) -> None:
    ca = credentials.new_authority()
    wire = Wire(config(ca, 0, cc=cc, window=4 << 20), config(ca, 1, cc=cc, window=4 << 20), loss=0.03)
    wire.until(lambda: wire.of("a", Handshaken) and wire.of("b", Handshaken))
    rng = random.Random(7)
    messages = [rng.randbytes(rng.choice([0, 1, 1451, 1452, 70_000, 1 << 20, 3 << 20])) for _ in range(40)]
    handles = [wire.a.send(m) for m in messages]
    assert handles == list(range(40))
    wire.until(lambda: len(wire.of("a", Acked)) == len(messages))
    got = [bytes(e.data) for e in wire.of("b", Message)]  # type: ignore[attr-defined]
    assert sorted(got) == sorted(messages)
    assert sorted(e.handle for e in wire.of("a", Acked)) == handles  # type: ignore[attr-defined]
    assert wire.a.queued == 0
    assert not wire.of("a", Closed) and not wire.of("b", Closed)


def test_both_ends_see_the_other_ranks_certificate() -> None:
    ca = credentials.new_authority()
    wire = Wire(config(ca, 3), config(ca, 5))
    wire.until(lambda: wire.of("a", Handshaken) and wire.of("b", Handshaken))
    for conn, rank in ((wire.a, 5), (wire.b, 3)):
        der = conn.peer_certificate()
        assert der is not None
        cert = x509.load_der_x509_certificate(der)
        assert credentials.check_peer(cert, [], ca.pem, JOB, {rank}, ca.names_key) == rank


@pytest.mark.parametrize("stranger", ["dialler", "listener"])
def test_a_certificate_from_another_ca_fails_the_handshake_on_both_ends(stranger: str) -> None:
    ca, other = credentials.new_authority(), credentials.new_authority()
    dialler = config(other, 0, trust=ca) if stranger == "dialler" else config(ca, 0)
    listener = config(other, 1, trust=ca) if stranger == "listener" else config(ca, 1)
    wire = Wire(dialler, listener)
    wire.until(lambda: wire.of("a", Closed) and wire.of("b", Closed))
    checker = wire.b if stranger == "dialler" else wire.a
    mine = wire.events["b" if stranger == "dialler" else "a"]
    theirs = wire.events["a" if stranger == "dialler" else "b"]
    closed = next(e for e in mine if isinstance(e, Closed))
    assert closed.origin == "tls"
    assert closed.reason.endswith("does not verify: The certificate is NOT trusted. The certificate issuer is unknown.")
    told = next(e for e in theirs if isinstance(e, Closed))
    assert told.origin == "peer" and told.reason == "the peer's TLS refused the handshake: Certificate is bad (alert 42)"
    assert not [e for e in mine if isinstance(e, Handshaken)]
    assert not [e for e in theirs if isinstance(e, Message)]
    with pytest.raises(ConnectionError, match="has ended"):
        checker.send(b"late")


def test_close_tells_the_peer_the_code_and_reason() -> None:
    ca = credentials.new_authority()
    wire = Wire(config(ca, 0), config(ca, 1))
    wire.until(lambda: wire.of("b", Handshaken))
    wire.a.close(0x0100, "rank 0 refuses: another job", wire.now)
    wire.until(lambda: wire.of("b", Closed))
    assert wire.of("a", Closed) == [Closed("us", 0x0100, "rank 0 refuses: another job")]
    assert wire.of("b", Closed) == [Closed("peer", 0x0100, "rank 0 refuses: another job")]


def test_a_dark_path_ends_both_connections_at_the_idle_timeout() -> None:
    ca = credentials.new_authority()
    wire = Wire(config(ca, 0, idle_timeout=1.5), config(ca, 1, idle_timeout=1.5))
    wire.until(lambda: wire.of("a", Handshaken) and wire.of("b", Handshaken))
    wire.dark = True
    start = wire.now
    wire.until(lambda: wire.of("a", Closed) and wire.of("b", Closed), step=0.01)
    assert [e.origin for e in wire.of("a", Closed) + wire.of("b", Closed)] == ["idle", "idle"]  # type: ignore
    assert 1.5 <= wire.now - start < 3.0  # virtual time: the test moves it


def test_a_datagram_that_is_no_initial_opens_nothing() -> None:
    ca = credentials.new_authority()
    with pytest.raises(ConnectionError, match="not a QUIC Initial"):
        Connection.accept(config(ca, 1), ("10.0.0.2", 2000), ("10.0.0.1", 1000), b"\x00" * 1200, 1.0)
    # an Initial's header on random bytes: no Initial key opens it, so no connection is left half made (one
    # was, and writing from it aborted the process)
    rng = random.Random(5)
    for _ in range(50):
        # version 1, 8-byte connection ids, no token, 1200 bytes of "packet number and payload"
        fake = b"\xc3\x00\x00\x00\x01\x08" + rng.randbytes(8) + b"\x08" + rng.randbytes(8) + b"\x00\x44\xb0" + \
            rng.randbytes(1200)
        with pytest.raises(ConnectionError, match="no client Initial could be read"):
            Connection.accept(config(ca, 1), ("10.0.0.2", 2000), ("10.0.0.1", 1000), fake, 1.0)


def test_a_missing_build_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "erdma_quic.ngtcp2._shim", None)
    ca = credentials.new_authority()
    with pytest.raises(PluginError, match="apt-get install libngtcp2-dev libngtcp2-crypto-gnutls-dev"):
        Connection.dial(config(ca, 0), ("10.0.0.1", 1), ("10.0.0.2", 2), 1.0)


def test_over_udp_on_loopback_with_batch_io() -> None:
    ca = credentials.new_authority()
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
            s.setblocking(False)
        pa, pb = (s.getsockname() for s in socks)
        now = time.monotonic()
        a = Connection.dial(config(ca, 0), pa, pb, now)
        a.flush_to(socks[0], now)
        select.select([socks[1]], [], [], 10)
        first, src = socks[1].recvfrom(65536)
        assert src == pa
        b = Connection.accept(config(ca, 1), pb, pa, first, now)
        rng = random.Random(3)
        messages = [rng.randbytes(4 << 20) for _ in range(8)]
        got: list[bytes] = []
        acked = 0
        sent = False
        deadline = time.monotonic() + 120  # a bound on a hang, not a speed check
        while acked < len(messages) and time.monotonic() < deadline:
            now = time.monotonic()
            for conn, sock in ((a, socks[0]), (b, socks[1])):
                conn.receive_from(sock, now)
                due = conn.get_timer()
                if due is not None and due <= now:
                    conn.handle_timer(now)
                while (ev := conn.next_event()) is not None:
                    assert not isinstance(ev, Closed), ev
                    if isinstance(ev, Handshaken) and conn is a and not sent:
                        for m in messages:
                            a.send(m)
                        sent = True
                    elif isinstance(ev, Message):
                        got.append(bytes(ev.data))
                    elif isinstance(ev, Acked):
                        acked += 1
                conn.flush_to(sock, now)
            timers = [t for t in (a.get_timer(), b.get_timer()) if t is not None]
            wait = max(0.0, min([*timers, now + 0.05]) - time.monotonic())
            select.select(socks, [], [], wait)
        assert acked == len(messages)
        assert sorted(got) == sorted(messages)
        assert a.rtt > 0
    finally:
        for s in socks:
            s.close()


def test_a_dialler_refuses_a_listener_with_another_name() -> None:
    ca = credentials.new_authority()
    expects = credentials.identity(ca.names_key, 1, JOB)
    wire = Wire(config(ca, 0, server_name=expects), config(ca, 2))
    wire.until(lambda: wire.of("a", Closed) and wire.of("b", Closed))
    assert wire.of("a", Closed)[0].origin == "tls"  # type: ignore[attr-defined]
    assert not wire.of("b", Handshaken)
    ok = Wire(config(ca, 0, server_name=expects), config(ca, 1))
    ok.until(lambda: ok.of("a", Handshaken) and ok.of("b", Handshaken))


def test_many_more_messages_than_streams_all_arrive_in_order_per_channel() -> None:
    ca = credentials.new_authority()
    wire = Wire(config(ca, 0, channels=2), config(ca, 1, channels=2), loss=0.02)
    wire.until(lambda: wire.of("a", Handshaken) and wire.of("b", Handshaken))
    messages = [b"m%04d" % i * (1 + i % 300) for i in range(600)]
    for m in messages:
        wire.a.send(m)
    wire.until(lambda: len(wire.of("a", Acked)) == len(messages))
    got = [bytes(e.data) for e in wire.of("b", Message)]  # type: ignore[attr-defined]
    assert sorted(got) == sorted(messages)
    for channel in (0, 1):  # a channel delivers its messages in the order they were sent
        mine = [m for i, m in enumerate(messages) if i % 2 == channel]
        assert [m for m in got if m in set(mine)] == mine


def test_a_placed_message_lands_bit_exact_in_the_callers_buffer_through_loss() -> None:
    """With ``head``, a longer message gives its head first; the rest goes where ``place`` says, whether it is
    placed at once, turns later (what came meanwhile is copied over), or never (it comes as the rest)."""
    ca = credentials.new_authority()
    head = 89
    wire = Wire(config(ca, 0, channels=3), config(ca, 1, channels=3, head=head, window=256 << 10), loss=0.03, seed=3)
    wire.until(lambda: wire.of("a", Handshaken) and wire.of("b", Handshaken))
    rng = random.Random(11)
    messages = [rng.randbytes(rng.choice([1, head, head + 1, 5000, 300_000, 1 << 20, 2 << 20])) for _ in range(40)]
    for m in messages:
        wire.a.send(m)
    got: list[bytes] = []
    waiting: dict[int, tuple[Head, bytearray, int]] = {}  # stream -> its head, the buffer, placed (turn) or -1
    handled, turn, placed, late, refused = 0, 0, 0, 0, 0
    while len(got) < len(messages):
        assert turn < 200_000, f"{len(got)} of {len(messages)} messages after {turn} turns"
        wire.turn()
        turn += 1
        for ev in wire.events["b"][handled:]:
            if isinstance(ev, Head):
                policy = ev.seq % 3  # 0: place now, 1: place 3 turns later, 2: never
                waiting[ev.stream] = (ev, bytearray(), -1 if policy == 2 else turn + 3 * policy)
            elif isinstance(ev, Placed):
                h, buf, _ = waiting.pop(ev.stream)
                assert ev.length == len(buf)
                got.append(h.data + bytes(buf))
            elif isinstance(ev, Message):
                h = waiting.pop(ev.stream, None)
                got.append((h[0].data if h else b"") + bytes(ev.data))
        handled = len(wire.events["b"])
        for stream, (h, buf, when) in list(waiting.items()):
            if when == turn:
                size = next(len(m) for m in messages if m[:head] == h.data) - head
                buf.extend(bytes(size))
                if wire.b.place(h, memoryview(buf)):
                    placed += 1
                    late += when > 0 and h.seq % 3 == 1
                else:
                    refused += 1
                waiting[stream] = (h, buf, -2)
    assert sorted(got) == sorted(messages)
    assert placed >= 5 and late >= 2, (placed, late, refused)
    assert all(len(h.data) == head for h in wire.of("b", Head))  # type: ignore[attr-defined]
    assert len(wire.of("b", Head)) == sum(len(m) > head for m in messages)


def test_place_after_the_message_came_whole_is_refused_and_the_rest_follows() -> None:
    ca = credentials.new_authority()
    wire = Wire(config(ca, 0), config(ca, 1, head=16))
    wire.until(lambda: wire.of("a", Handshaken) and wire.of("b", Handshaken))
    message = bytes(range(256)) * 4
    wire.a.send(message)
    wire.until(lambda: wire.of("b", Message))
    (h,) = wire.of("b", Head)
    assert h.data == message[:16]  # type: ignore[attr-defined]
    assert not wire.b.place(h, memoryview(bytearray(len(message) - 16)))  # type: ignore[arg-type]
    (rest,) = wire.of("b", Message)
    assert bytes(rest.data) == message[16:]  # type: ignore[attr-defined]


def _ticket(ca: credentials.Authority, keys: Tickets) -> bytes:
    """A ticket rank 1 got from rank 0's listener (keys ``keys``) over a full handshake."""
    wire = Wire(config(ca, 1, server_name=credentials.identity(ca.names_key, 0, JOB)), config(ca, 0, tickets=keys))
    wire.until(lambda: wire.of("a", Ticket))
    assert not wire.a.resumed and not wire.b.resumed
    return wire.of("a", Ticket)[0].data  # type: ignore[attr-defined]


def test_a_ticket_resumes_the_session_and_its_first_flight_carries_0rtt_data_taken_once() -> None:
    """The dialler resumes with the listener's ticket: the message it sent before its first flight reaches
    the listener from that flight alone (0-RTT), before any answer; the listener reads the dialler's
    certificate from the ticket; the same first flight replayed to the listener opens a resumption whose
    early data is refused and delivers nothing; the resumed connection hands out a fresh ticket."""
    ca, keys = credentials.new_authority(), Tickets()
    listener = config(ca, 0, tickets=keys, check_client=False)
    ticket = _ticket(ca, keys)
    wire = Wire(config(ca, 1, server_name=credentials.identity(ca.names_key, 0, JOB), ticket=ticket), listener,
                early=(b"before any answer",))
    arrived = []
    while (ev := wire.b.next_event()) is not None:
        arrived.append(ev)
    assert arrived == [Message(b"before any answer", stream=2)]  # from the first flight alone
    assert wire.b.resumed and wire.b.early_data_accepted
    cert = x509.load_der_x509_certificate(wire.b.peer_certificate() or b"")
    assert credentials.check_peer(cert, [], ca.pem, JOB, {1}, ca.names_key) == 1

    replay = Connection.accept(listener, ("10.0.0.2", 2000), ("10.0.0.1", 1000), wire.first[0], wire.now)
    replay.receive(wire.first[1:], wire.now)
    assert replay.next_event() is None and replay.resumed and not replay.early_data_accepted

    wire.until(lambda: wire.of("a", Handshaken) and wire.of("a", Acked) and wire.of("a", Ticket))
    assert wire.a.resumed and wire.a.early_data_accepted
    assert wire.of("a", Ticket)[0].data != ticket  # type: ignore[attr-defined]
    assert not wire.of("b", Message)  # nothing twice


def test_a_ticket_another_listener_sealed_resumes_nothing_and_its_0rtt_data_goes_again() -> None:
    """A ticket sealed with another endpoint's keys (a restarted peer's): the listener cannot open it, so the
    handshake is a full one with both certificates checked, the 0-RTT data is refused, and the dialler sends
    its messages again on new streams: each arrives once."""
    ca = credentials.new_authority()
    ticket = _ticket(ca, Tickets())
    early = tuple(bytes([i]) * (1000 + 70_000 * i) for i in range(5))
    wire = Wire(config(ca, 1, server_name=credentials.identity(ca.names_key, 0, JOB), ticket=ticket),
                config(ca, 0, tickets=Tickets()), early=early)
    wire.until(lambda: len(wire.of("a", Acked)) == len(early))
    assert not wire.a.resumed and not wire.a.early_data_accepted and not wire.b.resumed
    assert sorted(bytes(e.data) for e in wire.of("b", Message)) == sorted(early)  # type: ignore[attr-defined]
    assert wire.b.peer_certificate() is not None


def test_the_listener_follows_a_new_address_of_the_dialler_only_as_ngtcp2_validates_it() -> None:
    """A copy of one of the dialler's datagrams arriving from elsewhere moves nothing (the connection never
    took an address on a datagram's word; a stray one once redirected a whole transfer in the lab's NAT
    test). When the dialler's NAT rebinds, so that all of its datagrams come from a new address and only that
    address reaches it, the listener moves there and the transfer goes on."""
    ca = credentials.new_authority()
    wire = Wire(config(ca, 1), config(ca, 0))
    wire.until(lambda: wire.of("a", Handshaken) and wire.of("b", Handshaken))
    old, new = ("10.0.0.1", 1000), ("10.0.0.9", 4444)
    assert wire.b.remote == old
    wire.a.send(b"one")
    copy = wire.a.datagrams_to_send(wire.now)
    wire.b.receive_datagram(copy[0], wire.now, old)
    wire.b.receive_datagram(copy[0], wire.now, new)
    assert wire.b.remote == old and not [to for to, _ in wire.b.batches(wire.now) if to != old]

    payload = random.Random(3).randbytes(3 << 20)
    wire.a.send(payload)
    got: list[bytes] = []
    for _ in range(20_000):
        wire.now += 0.001
        for conn in (wire.a, wire.b):
            due = conn.get_timer()
            if due is not None and due <= wire.now:
                conn.handle_timer(wire.now)
        for d in wire.a.datagrams_to_send(wire.now):
            wire.b.receive_datagram(d, wire.now, new)
        for to, run in wire.b.batches(wire.now):
            if to == new:  # the old mapping is gone: what goes there is lost
                wire.a.receive(run, wire.now)
        while (ev := wire.b.next_event()) is not None:
            if isinstance(ev, Message):
                got.append(bytes(ev.data))
        if len(got) == 2 and wire.a.queued == 0:
            break
    assert got == [b"one", payload] and wire.a.queued == 0
    assert wire.b.remote == new


@pytest.mark.parametrize("gso", [False, True])
def test_the_demux_hands_a_connections_datagrams_to_it_in_c_and_forgets_a_freed_one(gso: bool) -> None:
    """The listener's socket read through a ``Demux``: its first flight comes back to the caller (a long
    header opens a connection), then the connection's datagrams go into it in C and only its token comes
    back; once the connection is freed its ids are gone from the table, and its datagrams come back to the
    caller again (nothing reads into freed memory). ``gso``: the dialler sends its runs as UDP GSO messages
    and the listener's socket takes them coalesced (UDP GRO), which the demux splits."""
    ca, demux = credentials.new_authority(), Demux()
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
            s.setblocking(False)
        if gso:
            socks[1].setsockopt(socket.SOL_UDP, 104, 1)  # UDP_GRO
        pa, pb = (s.getsockname() for s in socks)
        a = Connection.dial(config(ca, 0), pa, pb, time.monotonic())
        b: Connection | None = None
        message = random.Random(4).randbytes(2 << 20)
        got: list[bytes] = []
        tokens: set[int] = set()
        handed_back = 0
        a.send(message)
        deadline = time.monotonic() + 60  # a bound on a hang, not a speed check
        while not (got and a.queued == 0) and time.monotonic() < deadline:
            now = time.monotonic()
            a.flush_to(socks[0], now, gso=gso)
            select.select([socks[1]], [], [], 0.01)
            n, touched, others = demux.receive(socks[1].fileno(), now)
            tokens.update(touched)
            for data, sender in others:
                assert sender == pa
                handed_back += 1
                if b is None:
                    b = Connection.accept(config(ca, 1, demux=demux, token=7), pb, pa, data, now)
                else:
                    b.receive_datagram(data, now, sender)
            if b is not None:
                while (ev := b.next_event()) is not None:
                    if isinstance(ev, Message):
                        got.append(bytes(ev.data))
                b.flush_to(socks[1], now)
            a.receive_from(socks[0], now)
            for conn in (a, b):
                due = conn.get_timer() if conn is not None else None
                if due is not None and due <= now:
                    conn.handle_timer(now)
            while a.next_event() is not None:
                pass
        assert got == [message] and a.queued == 0
        assert tokens == {7} and handed_back >= 1  # the handshake came back; the data went in, in C
        assert (demux.coalesced > 100) if gso else demux.coalesced == 0  # 2 MiB: 1,400 full-size datagrams

        assert b is not None
        b.free()
        a.send(b"after")
        n, deadline = 0, time.monotonic() + 60
        while n == 0 and time.monotonic() < deadline:  # the pacer may hold the datagram a while (a busy host)
            now = time.monotonic()
            due = a.get_timer()
            if due is not None and due <= now:
                a.handle_timer(now)
            a.flush_to(socks[0], now)
            select.select([socks[1]], [], [], 0.05)
            n, touched, others = demux.receive(socks[1].fileno(), now)
        assert n >= 1 and touched == [] and len(others) == n
    finally:
        for s in socks:
            s.close()


def test_runs_carry_the_same_datagrams_as_one_copy_per_batch() -> None:
    """``runs``: what ``datagrams_to_send`` hands out, a batch at a time (one copy, no object per datagram),
    each for the address it goes to; a connection driven by runs alone completes a 1 MiB message."""
    ca = credentials.new_authority()
    wire = Wire(config(ca, 1), config(ca, 0))
    payload = random.Random(6).randbytes(1 << 20)
    got: list[bytes] = []
    for _ in range(5000):
        wire.now += 0.001
        for conn, peer, at in ((wire.a, wire.b, ("10.0.0.2", 2000)), (wire.b, wire.a, ("10.0.0.1", 1000))):
            due = conn.get_timer()
            if due is not None and due <= wire.now:
                conn.handle_timer(wire.now)
            for to, run in conn.runs(wire.now):
                assert isinstance(run, Run) and to == at and 1 <= run.count <= 64
                peer.receive(run.datagrams(), wire.now)
        while (ev := wire.a.next_event()) is not None:
            if isinstance(ev, Handshaken):
                wire.a.send(payload)
        while (ev := wire.b.next_event()) is not None:
            if isinstance(ev, Message):
                got.append(bytes(ev.data))
        if got and wire.a.queued == 0:
            break
    assert got == [payload] and wire.a.queued == 0


_OWNER_FIRST = """
import gc, random, sys
sys.path.insert(0, {tests!r})
from test_engine import Wire, config, credentials
from erdma_quic.ngtcp2.connection import Demux, Message
ca, demux = credentials.new_authority(), Demux()
wire = Wire(config(ca, 0), config(ca, 1, demux=demux, token=3))
del demux
gc.collect()  # the table's Python owner is gone first: the listener's connection still holds the table
payload = random.Random(5).randbytes(1 << 20)
wire.a.send(payload)
got = []
for _ in range(20000):
    wire.turn()
    got += [bytes(e.data) for e in wire.events["b"] if isinstance(e, Message)]
    wire.events["b"].clear()
    if got and wire.a.queued == 0:
        break
assert got == [payload], len(got)
for _ in range(50):  # connections in cycles, freed by the collector in whatever order it picks
    d = Demux()
    w = Wire(config(ca, 0), config(ca, 1, demux=d, token=4))
    w.cycle = w
    w.b.cycle, w.d = w, d
    del w, d
gc.collect()
del wire
gc.collect()
print("ok")
"""


def test_a_connection_keeps_the_demux_it_is_in_alive(tmp_path: Path) -> None:
    """The endpoint's ``Demux`` may be freed (by Python's collector, in any order) before its connections:
    each connection holds a reference to the table, which goes with the last of them. Run in a process of
    its own with freed memory overwritten (MALLOC_PERTURB_), so that a use of a freed table shows."""
    script = tmp_path / "owner_first.py"
    script.write_text(_OWNER_FIRST.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "MALLOC_PERTURB_": "165"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
