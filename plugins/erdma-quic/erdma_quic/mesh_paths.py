"""The mesh's paths to each peer: dialling (a peer's candidate addresses in the order of the traversal's
plan, checked at once, the most preferred that answers taken), moving to a better path while the pair runs
elsewhere (``path_recheck``: a trial connection that takes the link over once its handshake completes),
and redialling after an outage (a resumed session, the next address when the last one goes unanswered,
giving up after ``reconnect_timeout``). ``Mesh`` takes these methods in (a part of one class, in a file
of its own): they act on its tables."""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from erdma_core.toolkit import HELLO_REQUEST, Hello

from .engine import EngineConnection
from .mesh_state import Back, Configure, Event, Joined, Link, Session, Settings
from .streams import Inbound, hello_stream

log = logging.getLogger("erdma.quic")
REDIAL_DELAY = 0.05  # seconds between a connection's end and the first redial
REDIAL_RETRY = 0.5  # seconds a redial may go unanswered before another replaces it (a fresh first flight)


class Paths:
    """``Mesh``'s dialling, candidate and redial methods (see the module's docstring)."""

    s: Settings
    connection: Callable[..., EngineConnection]
    configure: Configure
    inbound_for: Callable[[int], Inbound]
    links: dict[int, Link]
    closing: bool
    released: frozenset[int]
    _dialling: dict[int, Link]
    _events: deque[Event]
    _now: float
    _stateless: list[tuple[bytes, Any]]

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

    def _dial(self, link: Link) -> Session:
        """Dial ``link``'s peer; the HELLO leaves with the first flight that can carry it (0-RTT when resuming)."""
        s = Session(link.rank, link.addr, dialled=True)
        s.offered = link.ticket
        s.conn = self.connection(configuration=self.configure(True, link.addr, link.rank, link.ticket),
                            session_ticket_handler=functools.partial(self._ticket_issued, s))
        s.conn.connect(link.addr, self._now)
        self._attach(link, s)
        self._send_raw(s, hello_stream(Hello(status=HELLO_REQUEST, job=self.s.job, rank=self.s.rank,
                                             world=self.s.world)))
        self._adopt(s)
        return s

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
        s.conn.connect(addr, self._now)
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
            s.conn.receive_datagram(data, addr, self._now)
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
        was = link.session.conn.peer_address()
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
                    *s.conn.peer_address()[:2], len(link.unacked))

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

    def _redial(self, link: Link, now: float) -> None:
        """``link``'s redial is due: no connection, or a redial nobody answered (its first flight may have been
        lost in the outage, and QUIC would wait longer than an idle timeout to send it again): dial again, at
        the plan's next address when the last went unanswered."""
        link.redial_at = None
        attempt = link.session
        if (attempt is not None and attempt.established) or link.dead or self.closing:
            return
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
