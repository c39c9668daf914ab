"""The QUIC connections of one endpoint (a rank, or one of its striping lanes) to its peers, sans-IO: who is
at the other end of each (a certificate checked at the handshake, or a session ticket issued to a peer
already identified), the HELLO exchange, each peer's queue of message parts, and reconnection.

Like aioquic's ``QuicConnection`` underneath, it takes the time as an argument and returns what to do as
data: ``receive``, ``unreachable``, ``dial``, ``send`` and ``handle_timer`` feed it; ``datagrams_to_send``,
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
from collections.abc import Callable, Container, Iterable
from typing import Any

import attrs
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.packet import QuicErrorCode
from aioquic.tls import SessionTicket

from erdma_core.sdk import PeerLostError, ProtocolError, Request
from erdma_core.toolkit import HELLO_ACCEPTED, HELLO_REQUEST, Hello

from .congestion import attach
from .credentials import CredentialError
from .retry import RetryGate, initial
from .streams import Inbound, StreamPlaced, close_reason, hello_stream, numbered

log = logging.getLogger("erdma.quic")
REFUSED = 0x0100  # application close code: credentials or HELLO refused
PROBE_AFTER = 0.25  # seconds of silence from a peer this rank waits for data from, before it is sent a PING
# seconds a peer whose port answered 'unreachable' has to be heard from again: a live peer behind a NAT that
# just changed its mapping may only be waiting for this rank's data, and speaks first with its own PING, which
# its probe timer sends within 2 * PROBE_AFTER of the silence beginning
UNREACHABLE_GRACE = 3 * PROBE_AFTER
REDIAL_DELAY = 0.05  # seconds between a connection's end and the first redial
REDIAL_RETRY = 0.5  # seconds a redial may go unanswered before another replaces it (a fresh first flight)
MAX_PENDING = 64  # accepted connections not yet identified
PER_SOURCE = MAX_PENDING // 2  # ... of them from one host (more from it make room among its own)
RETRY_ABOVE = MAX_PENDING // 4  # with this many under way, a first Initial is answered with a Retry (``retry``)
CID_LENGTH = 8
HELD_MAX = 16  # a check's answers held until it is taken (its peer's first flight, and resends of it)
_ENDED = (QuicConnectionState.CLOSING, QuicConnectionState.DRAINING, QuicConnectionState.TERMINATED)
Ticket = SessionTicket | bytes  # a session ticket the dialler keeps: aioquic's, or the compiled engine's (opaque)
Configure = Callable[[bool, Any, "int | None", "Ticket | None"], QuicConfiguration]
Identify = Callable[[Any, list[Any], set[int]], int]


@attrs.frozen(kw_only=True)
class Settings:
    rank: int
    world: int
    job: int
    window: int  # bytes handed to QUIC per peer and not yet acknowledged
    reconnect_timeout: float
    idle_timeout: float
    keepalive_interval: float
    verify: bool  # peers are identified by certificate (False: insecure mode, the HELLO names them)
    peers: frozenset[int] | None = None  # the ranks this endpoint connects with (None: every other rank)
    path_recheck: float = 0.0  # seconds between checks of a better path (``Mesh._recheck``); 0: none


@attrs.frozen
class Joined:
    """``peer``'s connection is up for the first time."""

    peer: int


@attrs.frozen
class Refused:
    """A connection this endpoint dialled to ``peer`` failed before the peer joined."""

    peer: int
    addr: Any
    why: str


@attrs.frozen
class Lost:
    """``peer``, which had joined, is gone for good; its queue waits for ``Mesh.fail``."""

    peer: int
    why: str


@attrs.frozen
class Back:
    """``peer``'s link runs on a new connection after an outage (perhaps on another of its addresses)."""

    peer: int


Event = Joined | Refused | Lost | Back


class Connection(QuicConnection):
    """aioquic's connection, with listeners asking the dialler for its certificate (mutual TLS), and the
    model-based controller's own pacer when that controller is configured.

    It is also the mesh's connection contract: aioquic's public surface (``connect``, ``receive_datagram``,
    ``datagrams_to_send``, ``get_timer``, ``handle_timer``, ``next_event`` with aioquic's events,
    ``get_next_available_stream_id``, ``send_stream_data``, ``send_ping``, ``close``, ``get_peer_address``)
    plus the methods below, which say in one place what the mesh needs of aioquic's internals. Another engine
    (``erdma_quic.ngtcp2.mesh_connection``) gives the mesh the same surface."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        attach(self)
        if not self._is_client:  # a stranger's failed handshake is the mesh's to report, at its pace (``_say``)
            self._logger = _Quiet(self._logger.logger, self._logger.extra)

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        if not self._is_client:
            self.tls._request_client_certificate = True

    def took_nothing(self) -> bool:
        """An accepted connection that could read nothing of its first datagram (no Initial)."""
        return self._state is QuicConnectionState.FIRSTFLIGHT

    def ended(self) -> bool:
        """Closing, draining or over: nothing more is read from it (aioquic says ``ConnectionTerminated`` only
        once its closing period is over)."""
        return self._state in _ENDED

    def end_reason(self) -> str:
        """Once ``ended``: why, as the close said it."""
        ev = self._close_event
        return close_reason(ev.error_code, ev.reason_phrase) if ev is not None else "closed"

    def free(self) -> None:
        """The mesh is done with this connection (a stranger's: dropped, refused or ended before anyone was
        identified on it), which is used no more: let go of what it holds now. aioquic's connection refers to
        itself from its parts (bound methods as the callbacks of its TLS context, loss recovery, packet
        protection and frame handlers), which only the cyclic collector would free; dropping its attributes and
        those of its parts frees it at once."""
        for part in list(vars(self).values()):
            for value in part.values() if isinstance(part, dict) else part if isinstance(part, list | tuple) else [part]:
                inner = getattr(value, "__dict__", None)  # a part that calls back into this connection
                if isinstance(inner, dict) and any(getattr(v, "__self__", None) is self for v in inner.values()):
                    inner.clear()
        self.__dict__.clear()

    def demux_token(self) -> int | None:
        """The token the endpoint's receive fast path reports for this connection (``heard``); None: it has
        none (every datagram comes through ``receive``)."""
        return None

    places = False  # aioquic hands a stream's data over in pieces, to be fed

    def place(self, stream_id: int, target: memoryview) -> None:
        """Where ``places``: the rest of ``stream_id`` (whose beginning came as ``StreamDataReceived`` without
        its end) goes straight into ``target``, the connection then says ``streams.StreamPlaced``; if the stream
        came whole meanwhile, its rest comes as ``StreamDataReceived`` after all."""
        raise NotImplementedError("aioquic's connection does not place stream data")

    def live_streams(self) -> Container[int]:
        """Streams not yet done: a sent stream leaves once the peer acknowledged all of it."""
        return self._streams

    def host_cids(self) -> list[bytes]:
        """This end's connection ids (a datagram to this connection carries one)."""
        return [c.cid for c in self._host_cids] + [self.host_cid]

    def peer_identity(self) -> tuple[Any, list[Any]]:
        """The peer's certificate and chain (cryptography objects) once the handshake is done."""
        return self.tls._peer_certificate, self.tls._peer_certificate_chain

    def session_resumed(self) -> bool:
        return bool(self.tls.session_resumed)

    def skip_client_certificate(self) -> None:
        """Listener: the dialler resumes a session, whose identity was proven before."""
        self.tls._request_client_certificate = False

    def bandwidth(self) -> float | None:
        """The bottleneck bandwidth (bytes/s) the model-based controller measured (cubic, reno: None)."""
        bw = getattr(self._loss._cc, "bandwidth", None)
        return float(bw) if bw else None

    def describe(self) -> str:
        """The congestion controller's state, for the log."""
        return f"{self._loss._cc.get_log_data()}, srtt {self._loss._rtt_smoothed:.5f} s"


class _Quiet(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aioquic's connection log with its warnings (one per failed handshake) said at DEBUG."""

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.debug(msg, *args, **kwargs)


class Outgoing:
    """One message waiting to be handed to QUIC: its streams, and the request that completes when it has."""

    __slots__ = ("done", "parts", "req")

    def __init__(self, parts: list[tuple[bytes, Any]], req: Request) -> None:
        self.parts, self.req, self.done = parts, req, 0


def answered(datagrams: list[tuple[Any, Any]], addr: Any) -> list[tuple[Any, Any]]:
    """A connection's datagrams, those to its peer's address as ``addr`` (the object its first datagram came
    with, which may say how it came: a TURN relay's ``Via``, answered through that relay) rather than as the
    engine rebuilt it. So each connection is answered the way it came, though two come from one address (a
    peer's direct check and its check through this rank's relay)."""
    return [(d, addr if to == addr else to) for d, to in datagrams]


class Session:
    """One QUIC connection."""

    def __init__(self, rank: int | None, addr: Any, dialled: bool) -> None:
        self.conn: Connection = None  # type: ignore[assignment]  # set right after
        self.rank = rank  # None for an accepted connection until its certificate, ticket or HELLO names it
        self.addr = addr
        self.dialled = dialled
        self.link: Link | None = None
        self.pre: Inbound | None = None  # before the peer is identified: HELLO only
        self.open_streams: dict[int, tuple[int, int]] = {}  # stream id -> (part number, bytes)
        self.ready = False  # carries the link's data
        self.probe = False  # dialler: a trial of a better path, carrying nothing until its handshake completes
        self.held: list[tuple[bytes, Any]] | None = None  # dialler: a first dial's check of another address, and
        # what answered it, not read until it is taken (``Mesh._take_check``)
        self.failure: str | None = None
        self.terminated = False
        self.resumed = False  # TLS session resumed from a ticket
        self.established = False  # the peer has answered (dialler: handshake done; listener: identified)
        self.last_rx = 0.0
        self.timer: float | None = None  # the connection's next timer, as of its last service
        self.suspect_since: float | None = None  # its port answered 'unreachable' then
        self.ticket_rank: int | None = None  # listener: the rank the offered ticket was issued to
        self.offered: Ticket | None = None  # dialler: the ticket it resumes with
        self.issued: SessionTicket | None = None  # listener: a ticket issued before the peer was identified


class Link:
    """What an endpoint keeps about one peer across connections: the queue, the parts handed to QUIC and
    not yet acknowledged (numbered, kept for a resend when ``keep``), the incoming side, the listener's
    latest session ticket, and the reconnection state."""

    def __init__(self, rank: int, addr: Any, dialler: bool, inbound: Inbound, keep: bool) -> None:
        self.rank, self.addr, self.dialler, self.inbound, self.keep = rank, addr, dialler, inbound, keep
        self.session: Session | None = None  # the connection now carrying the link
        self.queue: deque[Outgoing] = deque()
        self.unacked: dict[int, tuple[bytes, bytes]] = {}  # part number -> (prefix and header, payload)
        self.next_number = 1
        self.inflight = 0
        self.ticket: Ticket | None = None  # dialler: the listener's latest, for resumption (kept until spent)
        self.dead = False
        self.down_since: float | None = None
        self.redial_at: float | None = None
        self.give_up_at: float | None = None
        self.give_up_why = ""
        self.stats = {"reconnects": 0, "resumed": 0, "early_data": 0, "resent_parts": 0, "path_changes": 0}
        self.plan: list[Any] = [addr]  # dialler: the peer's addresses, in the order they are tried
        self.wait = 0.0  # seconds a first dial waits for an answer before it tries the next address
        self.check_at: float | None = None  # when the address now dialled has had its wait
        self.recheck_at: float | None = None  # when a better path is checked next (``Mesh._recheck``)
        self.probe: Session | None = None  # dialler: a connection to an earlier address of the plan, on trial
        self.probes = 0  # trials so far (which earlier address the next one goes to)
        self.punches: list[tuple[bytes, Any]] = []  # listener: datagrams that open its NAT to the dialler
        self.checks: list[Session] = []  # dialler, before it joins: connections to the plan's other addresses
        self.checked = False  # dialler: the first address had its wait: the next check that answers is taken

    def next_address(self) -> Any:
        """The plan's address after the one dialled now (round the plan)."""
        self.addr = self.plan[(self.plan.index(self.addr) + 1) % len(self.plan)]
        return self.addr


class Mesh:
    def __init__(self, settings: Settings, configure: Configure, identify: Identify,
                 inbound_for: Callable[[int], Inbound], awaited: Callable[[], Iterable[int]] | None = None,
                 connection: Callable[..., Connection] = Connection) -> None:
        """``connection`` makes a connection (aioquic's, or another engine's with the same surface);
        ``configure(client, addr, peer, ticket)`` gives a connection's aioquic configuration;
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
        self._tickets: dict[bytes, tuple[SessionTicket, int]] = {}  # issued to diallers: label -> (ticket, rank)
        self._dirty: dict[int, Session] = {}
        self._events: deque[Event] = deque()
        self._keepalive_at: float | None = None
        self.released: frozenset[int] = frozenset()  # peers another transport took (``release``)

    # ---- inputs ---------------------------------------------------------------------------------------
    def dial(self, peer: int, addr: Any, now: float, fallbacks: Iterable[Any] = (), wait: float = 0.0,
             first: Any = None) -> None:
        """Connect to ``peer`` (a lower rank) at ``addr``, or, when no answer completes the handshake within
        ``wait`` seconds, at each of ``fallbacks`` in turn; ``Joined`` or ``Refused`` follows. ``first``: one of
        ``fallbacks`` to dial first instead (the one an earlier set-up ended on); the addresses before it are
        still the better ones a later check tries (``path_recheck``)."""
        self._now = now
        if peer in self.released:
            return
        keep = self.s.reconnect_timeout > 0
        link = Link(peer, addr, True, self.inbound_for(peer), keep)
        link.plan += [a for a in fallbacks if a != addr]
        link.wait = wait
        if first is not None and first in link.plan:
            link.addr = first  # (its better addresses are left to ``path_recheck``)
        elif wait > 0:
            link.checks = [self._check(link, a) for a in link.plan[1:]]
        if link.addr != link.plan[-1] or link.checks:
            link.check_at = now + wait
        self._dialling[peer] = link
        self._dial(link)

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
            s.conn.receive_datagram(data, addr, now=now)
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
            if s.conn.get_peer_address() != addr or s.terminated or s.suspect_since is not None or link is None \
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
        item = Outgoing(parts, req)
        if urgent:
            link.queue.appendleft(item)
        else:
            link.queue.append(item)
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
            while link.queue:
                link.queue.popleft().req.complete(error)

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
                s.conn.send_ping(1)
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
                s.conn.handle_timer(now=now)
                self._touch(s)
            if s.suspect_since is not None and s.suspect_since + UNREACHABLE_GRACE <= now:
                self._confirm_unreachable(s)
        for link in list(self.links.values()):
            if link.recheck_at is not None and link.recheck_at <= now:
                self._recheck(link, now)
            if link.redial_at is not None and link.redial_at <= now:
                link.redial_at = None
                attempt = link.session
                if (attempt is None or not attempt.established) and not link.dead and not self.closing:
                    # no connection, or a redial nobody answered: its first flight may have been lost in the
                    # outage, and QUIC would wait longer than an idle timeout to send it again
                    if attempt is not None:
                        self._detach(attempt)
                        if len(link.plan) > 1:
                            was = link.addr
                            log.warning("rank %d: no answer from rank %d at %s:%d on redial; trying %s:%d",
                                        self.s.rank, link.rank, *was[:2], *link.next_address()[:2])
                    s = self._dial(link)
                    if self.s.verify:  # the listener knows who this is before it reads a byte: the backlog now
                        self._go(link, s)
                    link.redial_at = now + REDIAL_RETRY
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
                        s.conn.send_ping(0)
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
        return all(not link.queue and (link.session is None or not link.session.open_streams
                                       or link.session.terminated) for link in self.links.values()
                   if not link.dead and link.rank not in lost)

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
            addr = s.conn.get_peer_address() if s is not None and s.conn is not None else link.addr
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

    def _dial(self, link: Link) -> Session:
        """Dial ``link``'s peer; the HELLO leaves with the first flight that can carry it (0-RTT when resuming)."""
        s = Session(link.rank, link.addr, dialled=True)
        s.offered = link.ticket
        s.conn = self.connection(configuration=self.configure(True, link.addr, link.rank, link.ticket),
                            session_ticket_handler=functools.partial(self._ticket_issued, s))
        s.conn.connect(link.addr, now=self._now)
        self._attach(link, s)
        self._send_raw(s, hello_stream(Hello(status=HELLO_REQUEST, job=self.s.job, rank=self.s.rank,
                                             world=self.s.world)))
        self._adopt(s)
        return s

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
            got = s.conn.datagrams_to_send(now=self._now)
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
    def _fetch_ticket(self, s: Session, label: bytes) -> SessionTicket | None:
        """Listener: the dialler offers a ticket. Each is good once (a replayed first flight finds it gone)."""
        found = self._tickets.pop(label, None)
        if found is None:
            return None
        ticket, rank = found
        link = self.links.get(rank)
        if link is None or link.dead:
            return None
        s.ticket_rank = rank
        s.conn.skip_client_certificate()  # resumption carries the identity proven before
        return ticket

    def _ticket_issued(self, s: Session, ticket: Ticket) -> None:
        if s.dialled:
            if s.link is not None:
                s.link.ticket = ticket
        elif s.link is not None:
            self._keep_ticket(ticket, s.link.rank)
        else:
            s.issued = ticket

    def _keep_ticket(self, ticket: SessionTicket, rank: int) -> None:
        """Listener: ``ticket`` went to ``rank``; it replaces the one that rank held."""
        self._tickets = {k: v for k, v in self._tickets.items() if v[1] != rank}
        self._tickets[ticket.ticket] = (ticket, rank)

    # ---- what a connection reports ------------------------------------------------------------------------
    def _events_of(self, s: Session) -> None:
        if not s.dialled and s.link is None and s.failure is None and not s.terminated and s.conn.session_resumed():
            self._resumed(s)
        while (ev := s.conn.next_event()) is not None:
            if isinstance(ev, (events.StreamDataReceived, StreamPlaced)):
                self._stream_data(s, ev)
            elif isinstance(ev, events.HandshakeCompleted):
                self._handshake_done(s, ev)
            elif isinstance(ev, events.ConnectionTerminated):
                self._terminated(s, ev)

    def _stream_data(self, s: Session, ev: events.StreamDataReceived | StreamPlaced) -> None:
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
            if isinstance(ev, StreamPlaced):
                inbound.placed(ev.stream_id)
                return
            inbound.feed(ev.stream_id, ev.data, ev.end_stream)
            if not ev.end_stream and s.conn.places and (target := inbound.target(ev.stream_id)) is not None:
                s.conn.place(ev.stream_id, target)
        except ProtocolError as exc:
            if s.ready and link is not None:
                self._lose(link, f"it broke the protocol: {exc}")
            else:
                self._refuse(s, f"broke the protocol: {exc}")

    def _resumed(self, s: Session) -> None:
        """Listener: the dialler resumed a session (its 0-RTT data may follow at once): who it is comes from
        the ticket table (aioquic), or from the certificate sealed into the ticket (the compiled engine's
        GnuTLS tickets, checked as after a full handshake). Insecure mode: from its HELLO."""
        rank = s.ticket_rank
        if rank is None:
            if not self.s.verify:
                return
            rank = self._certified_rank(s)
            if rank is None:
                return
        s.resumed = True
        self._identified(s, rank)

    def _certified_rank(self, s: Session) -> int | None:
        """The rank the dialler's certificate proves; None once it was refused for it."""
        try:
            return self.identify(*s.conn.peer_identity(), self._diallers())
        except CredentialError as exc:
            self._refuse(s, str(exc))
            return None

    def _handshake_done(self, s: Session, ev: events.HandshakeCompleted) -> None:
        if s.dialled and s.probe:
            s.established = True
            self._promote(s)
            return
        if s.dialled:
            s.resumed, s.established = ev.session_resumed, True
            if s.link is not None:
                if s.link.ticket is s.offered:  # spent: the listener answered the flight that carried it
                    s.link.ticket = None
                if ev.session_resumed:
                    s.link.stats["resumed"] += 1
                    s.link.stats["early_data"] += int(ev.early_data_accepted)
                self._back(s.link, s)
            return
        if s.link is not None or not self.s.verify:  # identified by its ticket, or (insecure) by HELLO
            return
        rank = self._certified_rank(s)
        if rank is not None:
            self._identified(s, rank)

    def _identified(self, s: Session, rank: int) -> None:
        """Listener: the peer proved it is ``rank``; a new link, or an existing one that it reconnects."""
        link = self.links.get(rank)
        if link is not None and link.dead:
            self._refuse(s, f"rank {rank} was already given up as lost")
            return
        s.rank, s.established = rank, True
        if link is None:
            link = Link(rank, s.addr, False, self.inbound_for(rank), self.s.reconnect_timeout > 0)
        moved = self.links.get(rank) is link and link.down_since is None and link.session is not None
        self._attach(link, s)
        if s.issued is not None:
            self._keep_ticket(s.issued, rank)
        if moved:  # the dialler found a better path (``_recheck``) while the old one still worked
            link.stats["path_changes"] += 1
            log.warning("rank %d: rank %d moved to a new connection from %s:%d", self.s.rank, rank, *s.addr[:2])
            self._events.append(Back(rank))
        if self.links.get(rank) is link:  # a reconnection
            self._settled(s)
            if self.s.verify:
                self._go(link, s)  # what was not acknowledged goes again now

    def _on_hello(self, s: Session, hello: Hello) -> None:
        if s.dialled:
            if hello.status != HELLO_ACCEPTED or hello.rank != s.rank:
                self._refuse(s, f"answered HELLO with status {hello.status} as rank {hello.rank}")
                return
            link = s.link
            assert link is not None
            if not s.ready:
                self._go(link, s)
            if self.links.get(link.rank) is not link:
                self._join(link)
            return
        why = None
        if hello.job != self.s.job or hello.world != self.s.world:
            why = f"job {hello.job:#x} world {hello.world} (this job {self.s.job:#x}, world {self.s.world})"
        elif s.rank is not None and hello.rank != s.rank:
            why = f"its HELLO says rank {hello.rank}, its certificate rank {s.rank}"
        elif s.rank is None and hello.rank not in self._diallers():
            why = f"rank {hello.rank} is not expected here"
        if why is not None:
            self._refuse(s, why)
            return
        if s.link is None:
            self._identified(s, hello.rank)
            if s.link is None:
                return
        link = s.link
        self._send_raw(s, hello_stream(Hello(status=HELLO_ACCEPTED, job=self.s.job, rank=self.s.rank,
                                             world=self.s.world)))
        if not s.ready:
            self._go(link, s)
        if self.links.get(link.rank) is not link:
            self._join(link)

    def _try_next(self, link: Link, why: str) -> None:
        """A first dial got no answer at ``link.addr`` (or was refused there): dial the plan's next address;
        after the last, the connect timeout of the caller decides."""
        attempt = link.session
        link.check_at = None
        if link.dead or self.closing or (attempt is not None and attempt.established) or link.addr == link.plan[-1]:
            return
        was = link.addr
        log.warning("rank %d: rank %d at %s:%d: %s; trying %s:%d", self.s.rank, link.rank, *was[:2], why,
                    *link.next_address()[:2])
        if attempt is not None:
            self._detach(attempt)
        self._dial(link)
        if link.addr != link.plan[-1]:
            link.check_at = self._now + link.wait

    def _join(self, link: Link) -> None:
        self._dialling.pop(link.rank, None)
        link.check_at = None
        self._drop_checks(link)
        if link.session is not None:
            self._settled(link.session)
        self.links[link.rank] = link
        if self.s.path_recheck > 0 and self.s.verify:
            link.recheck_at = self._now + self.s.path_recheck
        self._events.append(Joined(link.rank))

    def punch_towards(self, peer: int, punches: list[tuple[bytes, Any]]) -> None:
        """Listener: ``punches`` (datagram, address) open this endpoint's NAT to dialler ``peer``'s direct
        addresses; sent again at each of its checks while the pair runs elsewhere (``_recheck``)."""
        link = self.links.get(peer)
        if link is not None:
            link.punches = list(punches)

    def _recheck(self, link: Link, now: float) -> None:
        """Every ``path_recheck`` seconds, while ``link`` runs on a later address of its plan than the first (a
        relay, or the peer's mapping where its own address is also offered): the dialler tries one earlier
        address with a connection of its own (``_probe_path``; the last trial, if it never completed, is
        dropped), and the listener sends its punches, so that the dialler's trial gets through its NAT."""
        link.recheck_at = now + self.s.path_recheck
        s = link.session
        if link.dead or self.closing or s is None or not s.ready or link.down_since is not None:
            return
        if not link.dialler:
            self._stateless += link.punches
            return
        if link.probe is not None:
            self._detach(link.probe)
            link.probe = None
        better = link.plan[:link.plan.index(link.addr)] if link.addr in link.plan else []
        if better:
            self._probe_path(link, better[link.probes % len(better)])
            link.probes += 1

    def _check(self, link: Link, addr: Any) -> Session:
        """A first dial's check of ``addr``: a connection whose answers are held (``Session.held``)."""
        return self._trial(link, addr, probe=False)

    def _trial(self, link: Link, addr: Any, probe: bool) -> Session:
        """A connection to ``link``'s peer at ``addr`` beside the one that carries the link, its HELLO queued: a
        probe of a better path, or a first dial's check (whose answers are held)."""
        s = Session(link.rank, addr, dialled=True)
        s.probe = probe
        s.held = None if probe else []
        s.conn = self.connection(configuration=self.configure(True, addr, link.rank, None),
                                 session_ticket_handler=functools.partial(self._ticket_issued, s))
        s.conn.connect(addr, now=self._now)
        self._send_raw(s, hello_stream(Hello(status=HELLO_REQUEST, job=self.s.job, rank=self.s.rank,
                                             world=self.s.world)))
        self._adopt(s)
        return s

    def _take_check(self, link: Link, why: str) -> None:
        """The first address had its wait (or was refused): the most preferred check that answered carries the
        link from now on (its held answers are read, its handshake completes) and the rest are dropped; none
        answered: the first to answer later is taken (``link.checked``)."""
        heard = [c for c in link.checks if c.held]
        if not heard or link.dead or self.closing:
            return
        s = min(heard, key=lambda c: link.plan.index(c.addr))
        link.checks.remove(s)
        self._drop_checks(link)
        was, held, s.held = link.addr, s.held or [], None
        log.warning("rank %d: rank %d at %s:%d: %s; %s:%d answered its check: taken", self.s.rank, link.rank,
                    *was[:2], why, *s.addr[:2])
        link.addr = s.addr
        self._attach(link, s)  # (the first address's connection, if any, is dropped)
        for data, addr in held:
            s.conn.receive_datagram(data, addr, now=self._now)
        self._touch(s)

    def _drop_checks(self, link: Link) -> None:
        for c in link.checks:
            self._detach(c)
        link.checks = []

    def _probe_path(self, link: Link, addr: Any) -> None:
        """Dial ``link``'s peer at ``addr`` beside the connection that carries the link. Once its handshake
        completes (the peer's certificate proved), it takes the link over (``_handshake_done``)."""
        link.probe = self._trial(link, addr, probe=True)

    def _promote(self, s: Session) -> None:
        """A trial of a better path completed its handshake: it carries its link from now on. What the old
        connection had in flight goes again on it (the peer drops parts it already had), and the peer, which
        identified the new connection by its certificate, has moved to it already."""
        link = self._link_of_probe(s)
        if link is None or link.dead or self.closing or link.session is None:
            self._detach(s)
            return
        was = link.session.conn.get_peer_address()
        s.probe, link.probe = False, None
        link.addr = s.addr
        self._attach(link, s)
        self._go(link, s)
        link.stats["path_changes"] += 1
        log.warning("rank %d: rank %d answered at %s:%d, a better path than %s:%d; the pair moved there (%d parts "
                    "sent again)", self.s.rank, link.rank, *s.addr[:2], *was[:2], len(link.unacked))
        self._events.append(Back(link.rank))

    def _link_of_probe(self, s: Session) -> Link | None:
        link = self.links.get(s.rank) if s.rank is not None else None
        return link if link is not None and link.probe is s else None

    def _settled(self, s: Session) -> None:
        """An accepted connection is no longer pending: it joined, or took over a link that had."""
        if s in self._pending:
            self._pending.remove(s)

    def _refuse(self, s: Session, why: str) -> None:
        who = f"rank {s.rank}" if s.rank is not None else "a peer"
        self._say("rank %d: refused the QUIC connection of %s at %s: %s", self.s.rank, who, s.addr, why)
        if not s.dialled:
            self.refusals.append(f"{who} at {s.addr[0]}:{s.addr[1]}: {why}")
        s.failure = why
        s.conn.close(error_code=REFUSED, reason_phrase=why[:200])
        self._touch(s)

    def _terminated(self, s: Session, ev: events.ConnectionTerminated) -> None:
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
        reason = close_reason(ev.error_code, ev.reason_phrase)
        link = s.link
        if link is not None and link.session is s and (s.ready or link.down_since is not None):
            idle = ev.error_code == QuicErrorCode.INTERNAL_ERROR and ev.reason_phrase == "Idle timeout"
            why = f"refused the connection: {reason}" if ev.error_code == REFUSED else f"connection ended ({reason})"
            self._ended(link, s, why, reconnectable=idle)
            return
        if s.failure is None:
            s.failure = f"refused the connection: {reason}" if ev.error_code == REFUSED else reason
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
            unanswered = ev.error_code == QuicErrorCode.INTERNAL_ERROR and ev.reason_phrase == "Idle timeout"
            if link is not None and link.session is s and unanswered and not self.closing:
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

    def _say(self, msg: str, *args: Any) -> None:
        """A warning about an accepted connection (a refusal, a dropped handshake): at most one a second, each
        saying how many were left unsaid since the last, so that strangers cannot flood the log (or block a rank
        whose stderr nobody reads)."""
        if self._now < self._quiet_until:
            self._unsaid += 1
            return
        if self._unsaid:
            msg += f" (and {self._unsaid} more like it in the last second)"
        self._quiet_until, self._unsaid = self._now + 1.0, 0
        log.warning(msg, *args)

    def _send_raw(self, s: Session, data: bytes) -> None:
        sid = s.conn.get_next_available_stream_id(is_unidirectional=True)
        s.conn.send_stream_data(sid, data, end_stream=True)

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
        for number in sorted(link.unacked):
            head, body = link.unacked[number]
            self._put(link, s, number, head, body)
            link.stats["resent_parts"] += 1
        if s.established:
            self._back(link, s)
        self._touch(s)

    def _back(self, link: Link, s: Session) -> None:
        """The peer answered on ``s``: an outage, if there was one, is over."""
        if link.down_since is None or s is not link.session:
            return
        waited = self._now - link.down_since
        link.down_since = link.give_up_at = link.redial_at = None
        link.stats["reconnects"] += 1
        self._events.append(Back(link.rank))
        log.warning("rank %d: connection to rank %d back after %.2f s (%s, at %s:%d); %d parts sent again",
                    self.s.rank, link.rank, waited, "TLS session resumed" if s.resumed else "full handshake",
                    *s.conn.get_peer_address()[:2], len(link.unacked))

    def _ended(self, link: Link, s: Session, why: str, reconnectable: bool) -> None:
        """The connection carrying the link is gone."""
        if s is not link.session:
            return
        link.session = None
        if link.inbound.closed_cleanly and not link.dead:  # it said BYE, then closed: nothing more reaches it
            self.fail(link.rank, self._gone(link.rank))
        if link.dead or self.closing or link.inbound.closed_cleanly:
            return
        if not (reconnectable and self.s.reconnect_timeout > 0):
            self._lose(link, why)
            return
        if link.down_since is None:
            link.down_since = self._now
            log.warning("rank %d: connection to rank %d ended (%s); %s for %.1f s", self.s.rank, link.rank, why,
                        "redialling" if link.dialler else "waiting for it to redial", self.s.reconnect_timeout)
            # the listener also allows for the dialler noticing the outage up to one idle timeout later
            grace = self.s.reconnect_timeout + (0 if link.dialler else self.s.idle_timeout)
            link.give_up_at, link.give_up_why = self._now + grace, why
        if link.dialler:
            link.redial_at = self._now + REDIAL_DELAY

    def _give_up(self, link: Link) -> None:
        link.give_up_at = None
        if link.dead:
            return
        attempt, link.session = link.session, None
        if attempt is not None:  # a redial still waiting for an answer
            self._detach(attempt)
        self._lose(link, f"{link.give_up_why}; no new connection within {self.s.reconnect_timeout:.1f} s")

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
        if s.open_streams:
            live = s.conn.live_streams()
            for sid in [x for x in s.open_streams if x not in live]:
                number, size = s.open_streams.pop(sid)
                link.inflight -= size
                link.unacked.pop(number, None)
        pushed = False
        while link.queue and link.inflight < self.s.window:
            pushed = True
            item = link.queue[0]
            head, body = item.parts[item.done]
            number = link.next_number
            link.next_number += 1
            head = numbered(head, number)
            if link.keep:
                body = bytes(body)  # the caller may reuse its buffer once the request completes
                link.unacked[number] = (head, body)
            self._put(link, s, number, head, body)
            item.done += 1
            if item.done == len(item.parts):
                link.queue.popleft()
                item.req.complete()
        return pushed

    def _put(self, link: Link, s: Session, number: int, head: bytes, body: Any) -> None:
        conn = s.conn
        sid = conn.get_next_available_stream_id(is_unidirectional=True)
        conn.send_stream_data(sid, head)
        conn.send_stream_data(sid, body, end_stream=True)
        size = len(head) + len(body)
        s.open_streams[sid] = (number, size)
        link.inflight += size
