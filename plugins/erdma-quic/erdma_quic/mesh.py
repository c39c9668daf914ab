"""The QUIC connections of one endpoint (a rank, or one of its striping lanes) to its peers, sans-IO: who is
at the other end of each (a certificate checked at the handshake, or a session ticket issued to a peer
already identified), the HELLO exchange, each peer's queue of message parts, and reconnection. This module
holds the tables of connections, what comes in (datagrams, timers) and what goes out; the rest is split by
job: identity and HELLO (``mesh_identity``), dialling, candidates and redial (``mesh_paths``), each peer's
queue and what QUIC holds of it (``mesh_queues``), and the state they share (``mesh_state``).

It speaks to each connection through the engine interface (``engine``: messages with handles, events for
the handshake, a message's data, its placement and the close), whichever engine runs it. Like the engines,
it takes the time as an argument and returns what to do as data:
``receive``, ``unreachable``, ``dial``, ``send`` and ``handle_timer`` feed it; ``datagrams_to_send``,
``get_timer`` and ``next_event`` (``Joined``, ``Refused``, ``Lost``, ``Back``) say what follows. ``driver`` (a rank)
and ``endpoint`` (a striping lane) are the thin adapters that move datagrams and time; tests drive two
meshes in memory.

A connection to a live peer can end without either process failing: an outage longer than
``idle_timeout``, or a NAT that forgot the path. When it ends by idle timeout and ``reconnect_timeout`` is
above zero, the dialling side dials again, resuming the TLS session with the ticket the listener gave it
(0-RTT: the HELLO and every part QUIC had not acknowledged leave in the first flight), and the listener
waits for it. Both sides then send again what QUIC had not acknowledged; the receiver drops parts it already
has (``streams.Inbound``). A peer that does not come back within the timeout is lost.

A peer may be reachable at several addresses (candidates: its own address at the same site, its NAT's
mapping, a TURN relay), in the order of preference the traversal's plan gives. A first dial checks them all
at once (ICE-like connectivity checks made by connecting): the first address is dialled, and each other one
with a connection of its own whose answer is held, unread, so that its handshake cannot complete. The first
address's handshake completing ends the checks; when it has not within the plan's wait (or it is refused),
the most preferred address that answered meanwhile is taken: its held answer is read and its handshake
completes. The listener takes whichever connection completes: only one ever does. A redial after an outage
that goes unanswered moves on to the next address, so a lost direct path falls back to the relay. The
reasons are logged.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from erdma_core.sdk import PeerLostError, ProtocolError, Request

from . import mesh_queues as queues
from .engine import Closed, EngineConnection, Handshaken, Placed, Received
from .mesh_identity import Identity
from .mesh_paths import Paths
from .mesh_state import (
    REFUSED,
    Back,
    Configure,
    Event,
    Identify,
    Joined,
    Link,
    Lost,
    Refused,
    Session,
    Settings,
    Ticket,
    answered,
)
from .retry import RetryGate, initial
from .streams import Inbound, close_reason

__all__ = ["REFUSED", "Back", "Event", "Joined", "Lost", "Mesh", "Refused", "Session", "Settings"]

log = logging.getLogger("erdma.quic")
PROBE_AFTER = 0.25  # seconds of silence from a peer this rank waits for data from, before it is sent a PING
# seconds a peer whose port answered 'unreachable' has to be heard from again: a live peer behind a NAT that
# just changed its mapping may only be waiting for this rank's data, and speaks first with its own PING, which
# its probe timer sends within 2 * PROBE_AFTER of the silence beginning
UNREACHABLE_GRACE = 3 * PROBE_AFTER
MAX_PENDING = 64  # accepted connections not yet identified
PER_SOURCE = MAX_PENDING // 2  # ... of them from one host (more from it make room among its own)
RETRY_ABOVE = MAX_PENDING // 4  # with this many under way, a first Initial is answered with a Retry (``retry``)
CID_LENGTH = 8
HELD_MAX = 16  # a check's answers held until it is taken (its peer's first flight, and resends of it)


class Mesh(Identity, Paths):
    """One endpoint's connections (see the module's docstring); its identity side is ``mesh_identity``'s, its
    paths ``mesh_paths``'s."""

    def __init__(self, settings: Settings, configure: Configure, identify: Identify,
                 inbound_for: Callable[[int], Inbound], awaited: Callable[[], Iterable[int]] | None = None, *,
                 connection: Callable[..., EngineConnection]) -> None:
        """``connection`` makes a connection (``engine.EngineConnection``: aioquic's adapter, or the compiled
        engine's); ``configure(client, addr, peer, ticket)`` gives a connection's settings;
        ``identify(certificate, chain, allowed_ranks)`` the rank a dialler's certificate proves (or raises
        ``CredentialError``); ``inbound_for(peer)`` where that peer's streams go; ``awaited()`` the peers this
        rank waits for data from: one silent for ``PROBE_AFTER`` is sent a PING, so that a peer that died
        while this rank only listened is found by its port's 'unreachable' answer, not at the next keepalive."""
        self.s = settings
        self.connection = connection
        self.configure, self.identify, self.inbound_for, self.awaited = configure, identify, inbound_for, awaited
        self._probe_at: float | None = None
        self.links: dict[int, Link] = {}  # peers that joined
        self._dialling: dict[int, Link] = {}  # dialled, not joined yet
        self.closing = False
        self.bad_datagrams = 0
        self.refusals: deque[str] = deque(maxlen=8)  # why the latest accepted connections were turned away
        self._now = 0.0
        self._sessions: set[Session] = set()
        self._by_cid: dict[bytes, Session] = {}
        self._by_token: dict[int, Session] = {}  # sessions the receive fast path reports by token
        self._pending: list[Session] = []  # accepted, not yet identified and settled
        self._gate = RetryGate()
        self._stateless: list[tuple[bytes, Any]] = []  # Retry packets to send: (datagram, address)
        self._done: list[Session] = []  # forgotten; their connections are let go of after the next output
        self.retries = 0  # Retry packets sent
        self._quiet_until, self._unsaid = 0.0, 0  # ``_say``'s
        self._tickets: dict[bytes, tuple[Ticket, int]] = {}  # issued to diallers: label -> (ticket, rank)
        self._dirty: dict[int, Session] = {}
        self._events: deque[Event] = deque()
        self._keepalive_at: float | None = None
        self.released: frozenset[int] = frozenset()  # peers another transport took (``release``)

    # ---- inputs ---------------------------------------------------------------------------------------
    def release(self, peers: frozenset[int]) -> None:
        """``peers`` are another transport's after all (a paired job checks both transports at once): their dials,
        checks, links and connections are dropped without a word (each of them drops its own end as it learns the
        same), and a connection one of them opens later is refused."""
        self.released |= peers
        for peer in peers:
            for link in (self.links.pop(peer, None), self._dialling.pop(peer, None)):
                if link is not None:
                    link.dead = True
                    link.check_at = link.redial_at = link.give_up_at = link.recheck_at = None
                    link.checks, link.probe = [], None  # (their connections go below)
        for s in [s for s in self._sessions if s.rank in peers]:
            s.link = None
            self._detach(s)

    def receive(self, data: bytes, addr: Any, now: float) -> None:
        self._now = now
        s = self._route(data, addr)
        if s is None:
            return
        s.last_rx = now
        if s.held is not None:  # a check's answer: its address works both ways; read once it is taken
            if len(s.held) < HELD_MAX:
                s.held.append((data, addr))
            link = self._dialling.get(s.rank) if s.rank is not None else None
            if link is not None and link.checked and s in link.checks:
                main = link.session
                self._take_check(link, main.failure if main is not None and main.failure else
                                 f"no answer within {link.wait:.1f} s")
            return
        try:
            s.conn.receive_datagram(data, addr, now)
        except Exception as exc:  # a datagram aioquic cannot take must not take the endpoint down
            self.bad_datagrams += 1
            log.debug("rank %d: dropped a datagram from %s: %s: %s", self.s.rank, addr, type(exc).__name__, exc)
        if not s.dialled and s.conn.took_nothing():
            # an accepted connection that took nothing from its first datagram (no Initial it could read: a
            # stray 0-RTT packet of a redial whose Initial was lost, or garbage) would hold a slot forever,
            # with no timer to end it
            self.bad_datagrams += 1
            self._forget(s)
            return
        self._touch(s)

    def heard(self, token: int, now: float) -> None:
        """The endpoint's receive fast path handed the connection ``token`` names datagrams itself (as
        ``receive`` would have)."""
        s = self._by_token.get(token)
        if s is not None:
            self._now = now
            s.last_rx = now
            self._touch(s)

    def unreachable(self, addr: Any, now: float) -> None:
        """``addr``'s port answered ICMP 'unreachable'. Its process is gone unless it is heard from again
        within ``UNREACHABLE_GRACE`` (a path that changed under it, e.g. NAT rebinding, is not a death)."""
        self._now = now
        for s in list(self._sessions):
            link = s.link
            if s.conn.peer_address() != addr or s.terminated or s.suspect_since is not None or link is None \
                    or link.session is not s or not (s.ready or link.down_since is not None):
                continue
            s.suspect_since = now

    def send(self, peer: int, parts: list[tuple[bytes, Any]], req: Request, urgent: bool = False) -> None:
        """Queue a message's parts (``streams.message_parts``) for ``peer``; ``req`` completes once QUIC has
        them all. ``urgent`` (an ABORT) goes before what is queued."""
        link = self.links.get(peer)
        if link is None or link.dead or (link.session is None and link.inbound.closed_cleanly):
            req.complete(self._gone(peer))
            return
        queues.queue(link, parts, req, urgent)
        if link.session is not None:
            self._touch(link.session)

    def land(self, peer: int, head: bytes, payload: memoryview, lane: int) -> None:
        """A data part of ``peer``'s that came whole over striping lane ``lane``."""
        link = self.links.get(peer)
        if link is None or link.dead:
            return
        try:
            link.inbound.land(head, payload)
        except ProtocolError as exc:
            self._lose(link, f"lane {lane}: {exc}")

    def lose(self, peer: int, why: str) -> None:
        """Something outside the mesh (a striping lane) lost ``peer``; nothing happens if it already said BYE."""
        link = self.links.get(peer)
        if link is not None and not link.inbound.closed_cleanly and not self.closing:
            self._lose(link, why)

    def fail(self, peer: int, error: BaseException) -> None:
        """Fail what is queued for ``peer`` (after ``Lost``) with ``error``."""
        link = self.links.get(peer)
        if link is not None:
            queues.fail(link, error)

    def _gone(self, peer: int) -> PeerLostError:
        return PeerLostError(f"rank {self.s.rank}: the QUIC connection to rank {peer} is closed", peer=peer,
                             rank=self.s.rank)

    def start_keepalive(self, now: float) -> None:
        self._keepalive_at = now + self.s.keepalive_interval
        if self.awaited is not None:
            self._probe_at = now + PROBE_AFTER

    def _probe(self, now: float) -> None:
        """PING the awaited peers that have been silent for ``PROBE_AFTER``."""
        assert self.awaited is not None
        self._probe_at = now + PROBE_AFTER
        if self.closing:
            return
        for peer in set(self.awaited()):
            link = self.links.get(peer)
            s = link.session if link is not None else None
            if s is not None and not s.terminated and s.ready and now - s.last_rx >= PROBE_AFTER:
                s.conn.ping()
                self._touch(s)

    def handle_timer(self, now: float) -> None:
        self._now = now
        for link in list(self._dialling.values()):
            if link.check_at is not None and link.check_at <= now:
                if link.checks:
                    link.check_at, link.checked = None, True
                    self._take_check(link, f"no answer within {link.wait:.1f} s")
                else:
                    self._try_next(link, f"no answer within {link.wait:.1f} s")
        for s in list(self._sessions):
            if s.timer is not None and s.timer <= now:
                s.timer = None
                s.conn.handle_timer(now)
                self._touch(s)
            if s.suspect_since is not None and s.suspect_since + UNREACHABLE_GRACE <= now:
                self._confirm_unreachable(s)
        for link in list(self.links.values()):
            if link.recheck_at is not None and link.recheck_at <= now:
                self._recheck(link, now)
            if link.redial_at is not None and link.redial_at <= now:
                self._redial(link, now)
            if link.give_up_at is not None and link.give_up_at <= now:
                self._give_up(link)
        if self._probe_at is not None and self._probe_at <= now:
            self._probe(now)
        if self._keepalive_at is not None and self._keepalive_at <= now:
            self._keepalive_at = now + self.s.keepalive_interval
            if not self.closing:
                for link in self.links.values():
                    s = link.session
                    if s is not None and not s.terminated:
                        s.conn.ping()
                        self._touch(s)

    def close(self, now: float) -> None:
        """Close every connection (each sends CONNECTION_CLOSE)."""
        self._now = now
        self.closing = True
        for s in list(self._sessions):
            log.debug("rank %d -> rank %s at close: %s", self.s.rank, s.rank, s.conn.describe())
            s.conn.close()
            self._touch(s)

    # ---- outputs --------------------------------------------------------------------------------------
    def datagrams_to_send(self, now: float) -> list[tuple[Any, Any]]:
        """What is due, as ``(datagram, address)``: a datagram is ``bytes``, or a whole batch of them (the
        compiled engine's ``Run``) where the socket side asked its connections for those."""
        self._now = now
        out: list[tuple[Any, Any]] = self._stateless
        self._stateless = []
        while self._dirty:
            dirty, self._dirty = self._dirty, {}
            for s in dirty.values():
                if s in self._sessions:
                    self._service(s, out)
        while self._done:
            self._release(self._done.pop())
        return out

    def get_timer(self) -> float | None:
        """When ``handle_timer`` is next due (None: nothing is). Called after every input, so kept cheap."""
        best = self._keepalive_at
        if self._probe_at is not None and (best is None or self._probe_at < best):
            best = self._probe_at
        for s in self._sessions:
            t = s.timer
            if s.suspect_since is not None:
                t = min(t, s.suspect_since + UNREACHABLE_GRACE) if t is not None else s.suspect_since + UNREACHABLE_GRACE
            if t is not None and (best is None or t < best):
                best = t
        for link in self.links.values():
            for t in (link.redial_at, link.give_up_at, link.recheck_at):
                if t is not None and (best is None or t < best):
                    best = t
        for link in self._dialling.values():
            if link.check_at is not None and (best is None or link.check_at < best):
                best = link.check_at
        return best

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    # ---- queries --------------------------------------------------------------------------------------
    def flushed(self, lost: frozenset[int] = frozenset()) -> bool:
        """Nothing queued, and every part handed to QUIC acknowledged, on every live link (but those to
        ``lost``: peers known to be gone, whose acknowledgements will never come)."""
        return queues.flushed(self.links.values(), lost)

    def pending_accepts(self) -> int:
        """Accepted connections not yet identified and settled (at most ``MAX_PENDING`` at a time)."""
        return len(self._pending)

    def link_rate(self, peer: int) -> float | None:
        """The bottleneck bandwidth (bytes/s) the congestion controller of the connection to ``peer`` measured
        (the model-based one keeps it; cubic and reno do not: None). Read from any thread: one attribute
        chain, no state changed."""
        link = self.links.get(peer)
        s = link.session if link is not None else None
        return s.conn.bandwidth() if s is not None and s.conn is not None else None

    def paths(self) -> dict[int, Any]:
        """Per peer that joined: the address its connection now runs to (or was dialled at last), as the object
        its first datagram came with while it runs there (which may say how it came: ``answered``)."""
        out = {}
        for r, link in self.links.items():
            s = link.session
            addr = s.conn.peer_address() if s is not None and s.conn is not None else link.addr
            out[r] = s.addr if s is not None and addr == s.addr else addr
        return out

    def link_stats(self) -> dict[int, dict[str, int]]:
        """Per peer: reconnections, resumed TLS sessions, accepted 0-RTT first flights, parts sent again."""
        return {r: dict(link.stats) for r, link in self.links.items()}

    # ---- connections ----------------------------------------------------------------------------------
    def _diallers(self) -> set[int]:
        """Ranks that dial this one (and may dial it again)."""
        higher = set(range(self.s.rank + 1, self.s.world)) - self.released
        return higher if self.s.peers is None else higher & self.s.peers

    def _admit(self, data: bytes, dcid: bytes, addr: Any) -> Session | None:
        """A datagram for no connection of this endpoint's: a new connection when it is a client's first
        Initial, the endpoint takes connections (a lower rank, not closing) and either the table of handshakes
        under way is below ``RETRY_ABOVE`` or the Initial carries this endpoint's Retry token for its sender's
        address; a Retry (and nothing kept) for another first Initial; nothing for the rest."""
        if self.closing or not self._diallers():
            return None
        packet = initial(data)
        if packet is None:  # another packet type (0-RTT or Handshake of a connection gone), a runt, garbage
            self.bad_datagrams += 1
            return None
        original, retried = dcid, None
        if packet.token:
            found = self._gate.original(packet, addr, self._now)
            if found is None:  # another endpoint's, an old one, or forged: nothing is kept for it
                self.bad_datagrams += 1
                return None
            original, retried = found, dcid
        elif len(self._pending) >= RETRY_ABOVE:
            self._stateless.append((self._gate.retry(packet, addr, self._now), addr))
            self.retries += 1
            return None
        s = self._accept(original, retried, addr)
        self._by_cid[dcid] = s
        self._adopt(s)
        return s

    def _accept(self, original: bytes, retried: bytes | None, addr: Any) -> Session:
        """A connection for a client's Initial (``original``: its first destination id; ``retried``: the id of
        the Retry it answered, or None). The table of handshakes under way holds at most ``MAX_PENDING``, at
        most ``PER_SOURCE`` of them from one host: a new one beyond either bound drops the oldest of its own
        host's, else the oldest of the host that holds most, so a flood of first flights from a few hosts
        never locks a rank out."""
        mine = [p for p in self._pending if p.addr[0] == addr[0]]
        victim = None
        if len(mine) >= PER_SOURCE:
            victim = mine[0]
        elif len(self._pending) >= MAX_PENDING:
            hosts: dict[str, list[Session]] = {}
            for p in self._pending:
                hosts.setdefault(p.addr[0], []).append(p)
            victim = max(hosts.values(), key=len)[0]
        if victim is not None:
            self._say("rank %d: %d QUIC handshakes under way (%d from %s); dropped the oldest of %s's", self.s.rank,
                      len(self._pending), len(mine), addr[0], victim.addr[0])
            self.refusals.append(f"{victim.addr[0]}:{victim.addr[1]}: dropped, {len(self._pending)} handshakes "
                                 "under way")
            victim.terminated = True
            self._forget(victim)
        s = Session(None, addr, dialled=False)
        s.pre = Inbound(-1, None, functools.partial(self._on_hello, s))
        s.conn = self.connection(configuration=self.configure(False, addr, None, None),
                                 original_destination_connection_id=original, retry_source_connection_id=retried,
                                 session_ticket_fetcher=functools.partial(self._fetch_ticket, s),
                                 session_ticket_handler=functools.partial(self._ticket_issued, s))
        self._pending.append(s)
        return s

    def _route(self, data: bytes, addr: Any) -> Session | None:
        if len(data) < 1 + CID_LENGTH:
            return None
        if data[0] & 0x80:  # long header: version, then the destination connection id with its length
            if len(data) < 6 or len(data) < 6 + data[5]:
                return None
            dcid = bytes(data[6:6 + data[5]])
        else:
            dcid = bytes(data[1:1 + CID_LENGTH])
        s = self._by_cid.get(dcid)
        if s is None and data[0] & 0x80:
            s = self._admit(data, dcid, addr)
        return s

    def _adopt(self, s: Session) -> None:
        self._sessions.add(s)
        token = s.conn.demux_token()
        if token is not None:
            self._by_token[token] = s
        for cid in s.conn.host_cids():
            self._by_cid[cid] = s
        self._touch(s)

    def _forget(self, s: Session) -> None:
        """``s`` is over: out of every table now; its connection is let go of once what it still had to send
        (its close) has gone (``datagrams_to_send``)."""
        if s not in self._sessions:
            return
        self._sessions.discard(s)
        token = s.conn.demux_token()
        if token is not None:
            self._by_token.pop(token, None)
        for cid in [c for c, x in self._by_cid.items() if x is s]:
            del self._by_cid[cid]
        if s in self._pending:
            self._pending.remove(s)
        self._done.append(s)

    def _release(self, s: Session) -> None:
        """After ``_forget``: nothing of ``s`` refers back to it, so it goes when the last reference does; a
        connection nobody was identified on (a stranger's) gives its engine's memory back at once. One that
        carried a link is left to reference counting: another thread may still read its rate (``link_rate``)."""
        s.pre = None
        if s.link is None and not s.established:
            s.conn.free()

    def _touch(self, s: Session) -> None:
        self._dirty[id(s)] = s

    def _service(self, s: Session, out: list[tuple[bytes, Any]]) -> None:
        self._events_of(s)
        self._pump(s)
        tagged = type(s.addr) is not tuple  # (an address that says how it came: ``answered``)
        while True:
            got = s.conn.datagrams_to_send(self._now)
            out += answered(got, s.addr) if tagged else got
            # building packets retires acknowledged streams, which may open the window: hand QUIC more now,
            # or nothing would ask again until the next timer
            if not self._pump(s):
                break
        if s.link is None and not s.dialled and s in self._sessions and (s.failure is not None or s.conn.ended()):
            # a stranger refused, or whose handshake failed: its close has just gone out, and no closing period
            # is kept for it (RFC 9000 10.2 allows an endpoint to discard its state once it sent CONNECTION_CLOSE)
            if s.failure is None:
                s.failure = s.conn.end_reason()
                self.refusals.append(f"a peer at {s.addr[0]}:{s.addr[1]}: {s.failure}")
                self._say("rank %d: the QUIC handshake of a peer at %s failed: %s", self.s.rank, s.addr, s.failure)
            self._forget(s)
        if s in self._sessions:  # (its events may have ended it: then it is in no table any more)
            for cid in s.conn.host_cids():
                self._by_cid.setdefault(cid, s)
        s.timer = s.conn.get_timer()

    # ---- session tickets (TLS resumption) -----------------------------------------------------------------
    # ---- what a connection reports ------------------------------------------------------------------------
    def _events_of(self, s: Session) -> None:
        if not s.dialled and s.link is None and s.failure is None and not s.terminated and s.conn.session_resumed():
            self._resumed(s)
        while (ev := s.conn.next_event()) is not None:
            if isinstance(ev, (Received, Placed)):
                self._stream_data(s, ev)
            elif isinstance(ev, Handshaken):
                self._handshake_done(s, ev)
            elif isinstance(ev, Closed):
                self._terminated(s, ev)

    def _stream_data(self, s: Session, ev: Received | Placed) -> None:
        link = s.link
        if s.failure is not None or s.terminated:
            return  # refused: closing, nothing more is read
        if link is None or link.session is not s:
            if self.s.verify:  # identification comes from the handshake, before any stream
                self._refuse(s, "sent stream data before it was identified")
                return
            inbound = s.pre  # insecure mode: the HELLO names the peer
        else:
            inbound = link.inbound
        if inbound is None:
            return
        try:
            if isinstance(ev, Placed):
                inbound.placed(ev.stream)
                return
            inbound.feed(ev.stream, ev.data, ev.end)
            if not ev.end and s.conn.places and (target := inbound.target(ev.stream)) is not None:
                s.conn.place(ev.stream, target)
        except ProtocolError as exc:
            if s.ready and link is not None:
                self._lose(link, f"it broke the protocol: {exc}")
            else:
                self._refuse(s, f"broke the protocol: {exc}")

    def _settled(self, s: Session) -> None:
        """An accepted connection is no longer pending: it joined, or took over a link that had."""
        if s in self._pending:
            self._pending.remove(s)

    def _terminated(self, s: Session, ev: Closed) -> None:
        if s.terminated:
            return
        s.terminated = True
        self._forget(s)
        if s.held is not None:  # a check that ended unanswered: one fewer; the last one, with the first address
            link = self._dialling.get(s.rank) if s.rank is not None else None  # refused: so is the dial
            if link is not None and s in link.checks:
                link.checks.remove(s)
                main = link.session
                if not link.checks and main is not None and main.terminated and main.failure is not None:
                    self._events.append(Refused(link.rank, main.addr, main.failure))
            return
        reason = close_reason(ev.code, ev.reason)
        link = s.link
        if link is not None and link.session is s and (s.ready or link.down_since is not None):
            why = f"refused the connection: {reason}" if ev.code == REFUSED else f"connection ended ({reason})"
            self._ended(link, s, why, reconnectable=ev.idle)
            return
        if s.failure is None:
            s.failure = f"refused the connection: {reason}" if ev.code == REFUSED else reason
            if not s.dialled and not s.established:  # the TLS handshake failed here (a certificate, the secret)
                self.refusals.append(f"a peer at {s.addr[0]}:{s.addr[1]}: {reason}")
        if s.dialled and s.rank is not None and self.links.get(s.rank) is None:
            link = self._dialling.get(s.rank)
            if link is not None and link.session is s and link.checks:  # the checks decide
                link.check_at, link.checked = None, True
                self._take_check(link, s.failure)
                return
            if link is not None and link.session is s and link.addr != link.plan[-1]:
                self._try_next(link, s.failure)
                return
            if link is not None and link.session is s and ev.idle and not self.closing:
                # the listener dropped the handshake unfinished (its table of handshakes full: a flood from this
                # rank's address) or nothing came back: not a refusal; dial again, the caller's connect timeout
                # bounds it
                log.info("rank %d: the handshake with rank %d at %s:%d went unanswered; dialling again",
                         self.s.rank, s.rank, *s.addr[:2])
                self._dial(link)
                return
            self._events.append(Refused(s.rank, s.addr, s.failure))

    def _detach(self, s: Session) -> None:
        """Another connection took over this one's link: drop it without a word."""
        s.terminated = True
        s.ready = False
        self._forget(s)

    def _confirm_unreachable(self, s: Session) -> None:
        since, s.suspect_since = s.suspect_since, None
        link = s.link
        if s.terminated or (since is not None and s.last_rx > since) or link is None or link.inbound.closed_cleanly:
            return
        s.terminated = True
        self._forget(s)
        self._ended(link, s, "its address answered port unreachable (its process ended, or a relay on the way is "
                    "gone)", reconnectable=False)

    def _send_raw(self, s: Session, data: bytes) -> None:
        s.conn.send(data)

    # ---- links ----------------------------------------------------------------------------------------
    def _attach(self, link: Link, s: Session) -> None:
        """``s`` carries the link from now on; a connection it replaces is dropped without a word (its peer
        has already given it up)."""
        old, link.session = link.session, s
        if old is not None and old is not s:
            self._detach(old)
        s.link = link
        link.inbound.on_hello = functools.partial(self._on_hello, s)
        link.inbound.reset()
        s.open_streams.clear()
        link.inflight = 0

    def _go(self, link: Link, s: Session) -> None:
        """``s`` may carry data: what QUIC had not acknowledged on the last connection goes first."""
        s.ready = True
        queues.resend(link, s)
        if s.established:
            self._back(link, s)
        self._touch(s)

    def _lose(self, link: Link, why: str) -> None:
        if link.dead:
            return
        link.dead = True
        link.unacked.clear()
        link.redial_at = link.give_up_at = None
        self._events.append(Lost(link.rank, why))

    def _pump(self, s: Session) -> bool:
        """Count what the peer acknowledged, then hand QUIC more while the window allows; True if it did."""
        link = s.link
        if link is None or s is not link.session or not s.ready or link.dead:
            return False
        return queues.pump(link, s, self.s.window)
