"""The connection logic (``mesh``) with no sockets and no clock: two ranks' meshes joined by an in-memory
network whose time the test moves. A message crosses; an outage longer than the idle timeout ends both
connections, the dialler redials with the listener's ticket (TLS resumption, 0-RTT), and what QUIC had not
acknowledged is sent again and lands once; a peer that stays dark is lost on both sides, on time."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from erdma_quic import credentials as cred
from erdma_quic.mesh import MAX_PENDING, PER_SOURCE, RETRY_ABOVE, Joined, Lost, Mesh, Refused
from erdma_quic.mesh_queues import HOLD_RTT
from erdma_quic.ngtcp2.connection import loaded
from erdma_quic.streams import Inbound, message_parts
from erdma_quic.tls import Tls
from erdma_quic.transport import connection_for, settings
from helpers import job_alpn, options

from erdma_core.sdk import Header, PeerLostError, Request
from erdma_core.toolkit import DATA, FrameInbox, Mailbox

JOB = 0x5EED


class Rank:
    """One rank's QUIC side as the transport builds it, minus the sockets and the loop."""

    def __init__(self, rank: int, world: int, addr: tuple[str, int], **opts: Any) -> None:
        o = options(**{"secret": "mesh", "datagram_size": 1452, "idle_timeout": 1.5, "reconnect_timeout": 3.0, **opts})
        ca = cred.derived_authority(b"mesh", JOB)
        tls = Tls(o, cred.issue(ca, rank, JOB), ca.pem, True, JOB, o["send_window_bytes"], o["part_bytes"])
        self.rank, self.addr, self.part_bytes = rank, addr, o["part_bytes"]
        self.mailbox = Mailbox(rank, JOB)
        self.inboxes = {p: FrameInbox(rank, p, self.mailbox) for p in range(world) if p != rank}
        self.mesh = Mesh(settings(o, rank, world, JOB, True), tls.configure, tls.identify,
                         lambda p: Inbound(p, self.inboxes[p], lambda h: None), connection=connection_for(o))
        self.events: list[Any] = []

    def send(self, peer: int, seq: int, payload: np.ndarray) -> Request:
        req = Request()
        self.mesh.send(peer, message_parts(_header(seq, payload.size), memoryview(payload), self.part_bytes), req)
        return req

    def recv(self, peer: int, seq: int, out: np.ndarray) -> Request:
        return self.mailbox.post_recv(peer, _header(seq, out.size), memoryview(out))


def _header(seq: int, n: int) -> Header:
    return Header(kind=DATA, job=JOB, dtype=9, opcode=1, seq=seq, numel=n, count=n, nbytes=n)


class Via(tuple):
    """A sender's address as a rank hears it through one of its aliases (``alias``), as erdma-p2p's
    ``relayed.Via`` is: what is sent back to it leaves from that alias."""

    alias: tuple[str, int]


class Net:
    """Datagrams between meshes after ``latency`` seconds; addresses in ``dark`` neither send nor receive.
    ``alias``: more addresses of a rank (as a TURN relay gives one): what reaches a rank through one is
    answered from it (per connection: the rank hears the sender as a ``Via``)."""

    def __init__(self, *ranks: Rank, latency: float = 0.005) -> None:
        self.ranks = {r.addr: r for r in ranks}
        self.now, self.latency = 0.0, latency
        self.dark: set[tuple[str, int]] = set()
        self.alias: dict[tuple[str, int], tuple[str, int]] = {}
        self._queue: list[tuple[float, int, bytes, Any, Any]] = []
        self._seq = itertools.count()
        self.delivered = 0

    def _flush(self) -> None:
        busy = True
        while busy:
            busy = False
            for r in self.ranks.values():
                for data, dst in r.mesh.datagrams_to_send(self.now):
                    busy = True
                    src = getattr(dst, "alias", r.addr)
                    if src not in self.dark and dst not in self.dark:
                        heapq.heappush(self._queue, (self.now + self.latency, next(self._seq), data, src, dst))
                while (ev := r.mesh.next_event()) is not None:
                    busy = True
                    r.events.append(ev)
                    if isinstance(ev, Lost):
                        r.mesh.fail(ev.peer, PeerLostError(f"rank {r.rank}: lost rank {ev.peer}: {ev.why}",
                                                           peer=ev.peer, rank=r.rank))

    def run(self, until: Callable[[], bool], seconds: float) -> bool:
        """Move time forward, event by event, until ``until()`` or ``seconds`` of simulated time passed."""
        end = self.now + seconds
        while True:
            self._flush()
            if until():
                return True
            timers = [t for r in self.ranks.values() if (t := r.mesh.get_timer()) is not None]
            nexts = timers + ([self._queue[0][0]] if self._queue else [])
            if not nexts or min(nexts) > end:
                self.now = end
                return until()
            self.now = max(self.now, min(nexts))
            while self._queue and self._queue[0][0] <= self.now:
                _, _, data, src, dst = heapq.heappop(self._queue)
                target = self.ranks.get(self.alias.get(dst, dst))
                if target is not None and dst not in self.dark:
                    self.delivered += 1
                    if dst != target.addr:
                        src = Via(src)
                        src.alias = dst
                    target.mesh.receive(data, src, self.now)
            for r in self.ranks.values():
                t = r.mesh.get_timer()
                if t is not None and t <= self.now:
                    r.mesh.handle_timer(self.now)


A, B = ("10.9.0.1", 4000), ("10.9.0.2", 4000)


def pair(latency: float = 0.005, **opts: Any) -> tuple[Net, Rank, Rank]:
    r0, r1 = Rank(0, 2, A, **opts), Rank(1, 2, B, **opts)
    net = Net(r0, r1, latency=latency)
    r1.mesh.dial(0, A, net.now)
    assert net.run(lambda: Joined(0) in r1.events and Joined(1) in r0.events, 5.0), (r0.events, r1.events)
    for r in (r0, r1):
        r.mesh.start_keepalive(net.now)
    return net, r0, r1


def test_two_meshes_join_and_move_a_message_in_memory():
    net, r0, r1 = pair()
    payload = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    out = np.zeros_like(payload)
    got = r0.recv(1, 1, out)
    sent = r1.send(0, 1, payload)
    assert net.run(lambda: got.done() and sent.done(), 10.0)
    assert sent.error is None and got.error is None and np.array_equal(out, payload)
    assert net.run(lambda: r1.mesh.flushed(), 5.0)  # every part acknowledged
    assert r0.mesh.link_stats() == {1: {"reconnects": 0, "resumed": 0, "early_data": 0, "resent_parts": 0,
                                        "path_changes": 0}}


ENGINES = ["aioquic", pytest.param("ngtcp2", marks=pytest.mark.skipif(loaded() is None, reason="the compiled "
                                                                     "engine is not built here (test_engine says why)"))]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cc", ["bbr", "cubic"])
def test_link_rate_is_what_the_model_measured(cc, engine):
    """The model-based controller's bottleneck bandwidth (bytes/s) is the link rate compression.policy = auto
    weighs codecs against; cubic keeps no such estimate, and a peer with no connection has none."""
    net, r0, r1 = pair(congestion_control=cc, engine=engine)
    assert r1.mesh.link_rate(5) is None
    out = np.zeros(4 << 20, np.uint8)
    got = r0.recv(1, 1, out)
    r1.send(0, 1, np.ones(4 << 20, np.uint8))
    assert net.run(lambda: got.done(), 20.0)
    rate = r1.mesh.link_rate(0)
    if cc == "bbr":
        conn = r1.mesh.links[0].session.conn
        model = conn.quic._loss._cc.bandwidth if engine == "aioquic" else conn._engine.delivery_rate
        assert rate == model and rate > 0
    else:
        assert rate is None


@pytest.mark.parametrize("engine", ENGINES)
def test_an_outage_longer_than_the_idle_timeout_reconnects_with_0rtt_and_each_part_lands_once(engine):
    """With either engine: the dialler resumes with the listener's ticket, its first flight (HELLO and the
    parts not acknowledged) is 0-RTT data the listener takes, and the ticket is spent (a new one replaces it)."""
    net, r0, r1 = pair(part_bytes=65536, engine=engine)
    before = r1.mesh.links[0].ticket
    assert before is not None
    first = np.random.default_rng(2).integers(0, 256, 4 << 20, dtype=np.uint8)
    out = np.zeros_like(first)
    got = r0.recv(1, 1, out)
    r1.send(0, 1, first)
    assert net.run(lambda: net.delivered > 200, 5.0)  # under way
    net.dark = {B}  # rank 1's path goes dark for 4 s: both connections end by idle timeout (1.5 s)
    assert not net.run(lambda: got.done(), 4.0)
    assert r1.mesh.links[0].down_since is not None and r0.mesh.links[1].down_since is not None
    net.dark = set()
    assert net.run(lambda: got.done(), 10.0)
    assert got.error is None and np.array_equal(out, first)
    stats = r1.mesh.link_stats()[0]
    assert stats["reconnects"] == 1 and stats["resumed"] == 1 and stats["early_data"] == 1
    assert r0.mesh.links[1].session.resumed
    assert r1.mesh.links[0].ticket is not None and r1.mesh.links[0].ticket is not before
    assert stats["resent_parts"] > 0  # what QUIC had not acknowledged went again ...
    assert r0.mesh.links[1].inbound.duplicates + r0.inboxes[1].completed >= 1  # ... and landed once
    assert r0.inboxes[1].completed == 1
    assert not [e for r in (r0, r1) for e in r.events if isinstance(e, (Lost, Refused))]
    # the link works on: a second message over the resumed connection
    second = np.arange(100_000, dtype=np.uint8)
    out2 = np.zeros_like(second)
    got2 = r1.recv(0, 2, out2)
    r0.send(1, 2, second)
    assert net.run(lambda: got2.done(), 5.0) and np.array_equal(out2, second)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("latency", [0.0002, 0.005])
def test_a_long_message_is_sent_from_the_callers_memory_and_its_request_waits_for_the_acknowledgement(engine,
                                                                                                       latency):
    """Over a short path (a round trip within ``HOLD_RTT``) the compiled engine reads a long part where the
    caller keeps it (no copy): its request completes only once the peer acknowledged every part, so a caller
    that reuses its buffer at once changes nothing that arrives. A short message, any message over a long path
    (10 ms round trips) and any on aioquic (which copies) complete as soon as QUIC has them."""
    net, r0, r1 = pair(latency, part_bytes=1 << 20, engine=engine)
    payload = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8)
    sent_as = payload.copy()
    out = np.zeros_like(payload)
    got = r0.recv(1, 1, out)
    sent = r1.send(0, 1, payload)
    short = r1.send(0, 2, np.ones(1000, np.uint8))
    assert net.run(lambda: short.done(), 0.001) and short.error is None  # QUIC took both, nothing came back
    held = engine == "ngtcp2" and 2 * latency <= HOLD_RTT
    assert sent.done() is not held
    assert net.run(lambda: sent.done(), 10.0) and sent.error is None
    if held:
        assert got.done() and r1.mesh.flushed() and not r1.mesh.links[0].held  # every part acknowledged
    payload[:] = 7  # the caller reuses its buffer
    assert net.run(lambda: got.done(), 10.0) and got.error is None
    assert np.array_equal(out, sent_as)


@pytest.mark.skipif(loaded() is None, reason="the compiled engine is not built here (test_engine says why)")
@pytest.mark.parametrize("reconnect", [3.0, 0.0])
def test_a_long_message_not_acknowledged_when_the_peer_is_lost_fails_with_the_loss(reconnect):
    """A request that waits for the peer's acknowledgement is failed with the loss, not left waiting."""
    net, _, r1 = pair(0.0002, engine="ngtcp2", reconnect_timeout=reconnect)
    net.dark = {A}  # rank 0 hears nothing more
    sent = r1.send(0, 1, np.ones(1 << 20, np.uint8))
    assert not sent.done()
    assert net.run(lambda: sent.done(), 30.0)
    assert isinstance(sent.error, PeerLostError) and sent.error.peer == 0
    assert not r1.mesh.links[0].held


@pytest.mark.parametrize("reconnect", [3.0, 0.0])
def test_a_peer_that_stays_dark_is_lost_on_both_sides_after_the_timeouts(reconnect):
    net, r0, r1 = pair(reconnect_timeout=reconnect)
    start = net.now
    queued = r1.send(0, 1, np.ones(1000, np.uint8))
    net.dark = {B}
    assert net.run(lambda: any(isinstance(e, Lost) for e in r0.events) and
                   any(isinstance(e, Lost) for e in r1.events), 30.0)
    lost0 = next(e for e in r0.events if isinstance(e, Lost))
    lost1 = next(e for e in r1.events if isinstance(e, Lost))
    assert lost0.peer == 1 and lost1.peer == 0
    if reconnect:
        assert lost1.why == "connection ended (Idle timeout); no new connection within 3.0 s"
        # the dialler gives up after idle + reconnect; the listener allows one more idle timeout
        assert net.now - start < 1.5 * 2 + 3.0 + 1.5 + 1.0
    else:
        assert lost1.why == "connection ended (Idle timeout)"
    assert queued.done() and (queued.error is None or isinstance(queued.error, PeerLostError))
    later = r1.send(0, 2, np.ones(10, np.uint8))
    assert later.done() and isinstance(later.error, PeerLostError)


def test_a_dialler_moves_on_to_the_next_address_when_one_does_not_answer_and_after_an_outage(caplog):
    """ICE-like checks made by connecting: rank 0 is at A and at RELAY (an alias, as a TURN allocation is).
    With A dark, rank 1 waits its 1 s for A, then takes RELAY, checked meanwhile. Joined at A, an outage of A
    ends the connection; the redial that A does not answer moves on to RELAY, and the link comes back there."""
    relay = ("10.9.0.3", 5000)
    r0, r1 = Rank(0, 2, A), Rank(1, 2, B)
    net = Net(r0, r1)
    net.alias[relay] = A
    net.dark = {A}
    r1.mesh.dial(0, A, net.now, [relay], 1.0)
    assert net.run(lambda: Joined(0) in r1.events and Joined(1) in r0.events, 5.0), (r0.events, r1.events)
    assert net.now >= 1.0 and r1.mesh.paths() == {0: relay}
    assert f"rank 1: rank 0 at {A[0]}:{A[1]}: no answer within 1.0 s; {relay[0]}:{relay[1]} answered its check: " \
           "taken" in caplog.text

    r0, r1 = Rank(0, 2, A), Rank(1, 2, B)
    net = Net(r0, r1)
    net.alias[relay] = A
    r1.mesh.dial(0, A, net.now, [relay], 1.0)
    assert net.run(lambda: Joined(0) in r1.events and Joined(1) in r0.events, 5.0)
    assert r1.mesh.paths() == {0: A} and net.now < 1.0  # the first address answered: it is kept
    for r in (r0, r1):
        r.mesh.start_keepalive(net.now)
    net.run(lambda: False, 2.0)  # past the first address's wait: nothing moves
    assert r1.mesh.paths() == {0: A}
    before = r1.mesh.link_stats()[0]["reconnects"]  # idle timeouts the keepalive interval lets happen here
    payload = np.arange(300_000, dtype=np.uint8)
    out = np.zeros_like(payload)
    got = r0.recv(1, 1, out)
    net.dark = {A}  # the direct path breaks for good
    r1.send(0, 1, payload)
    assert net.run(lambda: got.done(), 15.0), r1.events
    assert got.error is None and np.array_equal(out, payload)
    assert r1.mesh.paths() == {0: relay} and r1.mesh.link_stats()[0]["reconnects"] == before + 1
    assert f"no answer from rank 0 at {A[0]}:{A[1]} on redial; trying {relay[0]}:{relay[1]}" in caplog.text
    assert not [e for r in (r0, r1) for e in r.events if isinstance(e, (Lost, Refused))]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("lit", [{"A"}, {"MAPPED", "RELAY"}, {"RELAY"}, set()])
def test_a_first_dial_checks_every_address_at_once_and_one_connection_completes(engine, lit):
    """Rank 0 is at A (its own address), MAPPED (its NAT's mapping) and RELAY, in that order, each dark unless
    ``lit``; the plan's wait is 1 s. Every address is checked at once: the link joins on the first address if
    it answers, else at the wait on the most preferred one that answered (not after one wait per address),
    else not at all. The listener identifies one connection only: the checks that were not taken never
    complete their handshake."""
    mapped, relay = ("10.9.0.4", 6000), ("10.9.0.3", 5000)
    named = {"A": A, "MAPPED": mapped, "RELAY": relay}
    r0, r1 = Rank(0, 2, A, engine=engine), Rank(1, 2, B, engine=engine)
    net = Net(r0, r1)
    net.alias.update({mapped: A, relay: A})
    net.dark = {addr for name, addr in named.items() if name not in lit}
    r1.mesh.dial(0, A, net.now, [mapped, relay], 1.0)
    joined = net.run(lambda: Joined(0) in r1.events and Joined(1) in r0.events, 5.0)
    if not lit:
        assert not joined and not r0.mesh.links and not r1.mesh.links
        return
    assert joined, (r0.events, r1.events)
    best = next(named[n] for n in ("A", "MAPPED", "RELAY") if n in lit)
    assert r1.mesh.paths() == {0: best}
    assert (net.now < 0.5) if best == A else (1.0 <= net.now < 1.5), net.now
    net.run(lambda: False, 1.0)
    assert r1.mesh.paths() == {0: best} and r0.mesh.link_stats()[1]["path_changes"] == 0
    assert not [e for r in (r0, r1) for e in r.events if isinstance(e, (Lost, Refused))]
    assert [e for e in r0.events if isinstance(e, Joined)] == [Joined(1)]
    payload = np.arange(50_000, dtype=np.uint8)
    out = np.zeros_like(payload)
    got = r0.recv(1, 1, out)
    r1.send(0, 1, payload)
    assert net.run(lambda: got.done(), 5.0) and got.error is None and np.array_equal(out, payload)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_pair_on_its_relay_moves_to_the_direct_address_once_it_answers_and_nothing_is_lost(engine, caplog):
    """Rank 0 is at A and at RELAY. A dark at the start: the pair joins through RELAY. A lit again mid-message:
    the dialler's next check (``path_recheck``, 1 s) completes a handshake at A and the link moves there; a
    4 MiB message under way lands whole, once, and both ends run on A."""
    relay = ("10.9.0.3", 5000)
    r0, r1 = (Rank(r, 2, addr, engine=engine, part_bytes=65536, path_recheck=1.0) for r, addr in ((0, A), (1, B)))
    net = Net(r0, r1)
    net.alias[relay] = A
    net.dark = {A}
    r1.mesh.dial(0, A, net.now, [relay], 0.5)
    assert net.run(lambda: Joined(0) in r1.events and Joined(1) in r0.events, 5.0), (r0.events, r1.events)
    for r in (r0, r1):
        r.mesh.start_keepalive(net.now)
    assert r1.mesh.paths() == {0: relay}
    net.run(lambda: False, 2.5)  # checks of A while it is dark: each trial dropped at the next, nothing moves
    assert r1.mesh.paths() == {0: relay} and r1.mesh.link_stats()[0]["path_changes"] == 0
    link = r1.mesh.links[0]
    assert link.recheck_at is not None
    net.run(lambda: net.now >= link.recheck_at - 0.05, 2.0)  # (the next check is due in 50 ms)
    first = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
    out = np.zeros_like(first)
    got = r0.recv(1, 1, out)
    r1.send(0, 1, first)
    net.dark = set()
    assert net.run(lambda: r1.mesh.paths() == {0: A}, 1.0), r1.events  # moved, the message under way
    assert not got.done()
    assert net.run(lambda: got.done(), 10.0), r1.events
    assert got.error is None and np.array_equal(out, first) and r0.inboxes[1].completed == 1
    assert r1.mesh.paths() == {0: A} and r0.mesh.paths()[1] == B
    assert r1.mesh.link_stats()[0]["path_changes"] == 1 and r0.mesh.link_stats()[1]["path_changes"] == 1
    assert f"rank 1: rank 0 answered at {A[0]}:{A[1]}, a better path than {relay[0]}:{relay[1]}" in caplog.text
    assert not [e for r in (r0, r1) for e in r.events if isinstance(e, (Lost, Refused))]
    second = np.arange(100_000, dtype=np.uint8)  # the link works on, both ways
    out2 = np.zeros_like(second)
    got2 = r1.recv(0, 2, out2)
    r0.send(1, 2, second)
    assert net.run(lambda: got2.done(), 5.0) and np.array_equal(out2, second)


def test_a_dialler_with_a_certificate_of_another_job_is_refused_in_memory():
    r0 = Rank(0, 2, A)
    other = Rank(1, 2, B)
    ca = cred.derived_authority(b"mesh", JOB + 1)  # the right secret, another job
    o = options(secret="mesh", datagram_size=1452)
    other.mesh.configure = Tls(o, cred.issue(ca, 1, JOB + 1), ca.pem, True, JOB + 1, o["send_window_bytes"],
                               o["part_bytes"]).configure
    net = Net(r0, other)
    other.mesh.dial(0, A, net.now)
    assert net.run(lambda: any(isinstance(e, Refused) for e in other.events), 10.0)
    refused = next(e for e in other.events if isinstance(e, Refused))
    assert refused.peer == 0 and cred.identity(ca.names_key, 0, JOB + 1) in refused.why  # not the name it expected
    assert net.run(lambda: r0.mesh.pending_accepts() == 0, 10.0)  # the refused connection leaves the table
    assert r0.mesh.links == {}


def test_datagrams_that_open_nothing_hold_no_slot():
    """A long-header datagram with an unknown connection id that aioquic cannot read (garbage, or a 0-RTT
    packet whose Initial was lost) must not leave an accepted connection behind: it would have no timer and
    hold one of the listener's 64 slots for good."""
    r0 = Rank(0, 2, A)
    rng = np.random.default_rng(5)
    for kind in (0xC0, 0xD0, 0xE0):  # Initial-, 0-RTT- and Handshake-typed headers, random bodies
        for _ in range(100):
            body = bytes([kind | 0x03]) + b"\x00\x00\x00\x01" + bytes([8]) + rng.bytes(8) + bytes([8]) + rng.bytes(1200)
            r0.mesh.receive(body, B, 0.0)
            r0.mesh.datagrams_to_send(0.0)
    assert r0.mesh.pending_accepts() == 0 and r0.mesh.bad_datagrams == 300


def _stranger(alpn: str | None = None) -> Any:
    """A genuine QUIC client (aioquic) without a certificate, that does not check the listener's."""
    import ssl

    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection

    conn = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=[alpn or job_alpn()],
                                                          verify_mode=ssl.CERT_NONE))
    conn.connect(A, now=0.0)
    return conn


def _is_retry(data: Any) -> bool:
    return isinstance(data, bytes) and data[0] & 0xF0 == 0xF0  # long header, fixed bit, type Retry


def test_a_flood_of_first_flights_is_answered_by_retries_and_never_locks_a_rank_out():
    """Real QUIC Initials from 200 addresses that never answer: the first RETRY_ABOVE each take a slot of the
    listener's handshake table, every later one is answered with a stateless Retry and nothing is kept for it;
    a rank that dials afterwards passes the Retry (its token proves its address) and joins."""
    r0, r1 = Rank(0, 2, A), Rank(1, 2, B)
    answers = []
    for i in range(200):
        addr = (f"10.66.{i // 250}.{i % 250}", 5000)
        for data, _ in _stranger().datagrams_to_send(now=0.0):
            r0.mesh.receive(data, addr, 0.0)
        answers += [(d, a) for d, a in r0.mesh.datagrams_to_send(0.0) if _is_retry(d)]
    assert r0.mesh.pending_accepts() == RETRY_ABOVE and r0.mesh.retries == 200 - RETRY_ABOVE
    assert [a for _, a in answers] == [(f"10.66.0.{i}", 5000) for i in range(RETRY_ABOVE, 200)]
    net = Net(r0, r1)
    r1.mesh.dial(0, A, net.now)
    assert net.run(lambda: any(isinstance(e, Joined) for e in r1.events), 10.0)
    assert any(isinstance(e, Joined) and e.peer == 1 for e in r0.events)
    assert r0.mesh.retries == 200 - RETRY_ABOVE + 1  # rank 1's first Initial was answered with one too


def test_strangers_that_pass_the_retry_hold_a_bounded_share_of_the_table():
    """Clients that answer the Retry with its token (their address is real) and then go silent mid-handshake:
    one host holds at most PER_SOURCE slots, all hosts together MAX_PENDING, each newcomer beyond either
    dropping the oldest of the host that holds most; every dropped connection leaves the tables at once."""
    r0 = Rank(0, 2, A)
    strangers = []
    for i in range(150):
        host = "10.66.0.1" if i < 100 else f"10.66.1.{i}"  # one host's flood, then 50 hosts of one each
        strangers.append((_stranger(), (host, 5000 + i)))
    for _ in range(2):  # the first Initial, then (answered with a Retry) the one with its token
        for conn, addr in strangers:
            for data, _ in conn.datagrams_to_send(now=0.0):
                r0.mesh.receive(data, addr, 0.0)
            for data, to in r0.mesh.datagrams_to_send(0.0):
                if to == addr and _is_retry(data):
                    conn.receive_datagram(data, addr=A, now=0.0)
    pending = r0.mesh._pending
    assert len(pending) == MAX_PENDING
    assert sum(s.addr[0] == "10.66.0.1" for s in pending) == MAX_PENDING - 50 < PER_SOURCE
    assert {s.addr[0] for s in pending if s.addr[0] != "10.66.0.1"} == {f"10.66.1.{i}" for i in range(100, 150)}
    assert len(r0.mesh._sessions) == MAX_PENDING and len(set(r0.mesh._by_cid.values())) == MAX_PENDING


def test_a_refused_strangers_connection_is_in_no_table_and_its_engine_freed():
    """A stranger without a certificate completes its handshake and is refused: once its close is out, nothing
    of the listener's refers to its session, and its connection has let go of the engine."""
    r0 = Rank(0, 2, A)
    conn = _stranger()
    session = None
    for _ in range(20):
        for data, _ in conn.datagrams_to_send(now=0.0):
            r0.mesh.receive(data, B, 0.0)
        session = session or next(iter(r0.mesh._sessions))
        for data, _ in r0.mesh.datagrams_to_send(0.0):
            conn.receive_datagram(data, addr=A, now=0.0)
    assert r0.mesh.refusals[-1].endswith("it presented no certificate"), r0.mesh.refusals
    assert r0.mesh.pending_accepts() == 0 and not r0.mesh._sessions and not r0.mesh._by_cid
    assert not r0.mesh._by_token and not r0.mesh._done
    assert session is not None and session.pre is None
    assert getattr(session.conn, "_engine", None) is None  # the compiled engine's connection: freed
    assert not vars(session.conn.quic) if hasattr(session.conn, "quic") else True  # aioquic's: its parts dropped


def test_the_transport_keeps_no_matching_abort_or_bye_of_its_own():
    """They are the core's (MessageTransport), as for TCP; QUIC adds set-up, posting and shutdown."""
    from erdma_quic.transport import QuicTransport

    from erdma_core.toolkit import MessageTransport

    assert issubclass(QuicTransport, MessageTransport)
    assert not {"connect", "isend", "irecv", "begin", "abort", "close", "peer_lost"} & set(vars(QuicTransport))
