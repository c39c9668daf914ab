"""The mesh's identity side: who is at the other end of a connection and whether it belongs here. A dialler
is identified by its certificate at the handshake (``identify``: the job's CA, its rank's name), or by the
session ticket it resumes with (aioquic's ticket table here; the compiled engine seals the certificate into
its own tickets), or, in insecure mode, by its HELLO; the HELLO exchange then checks job, world and rank.
A connection that fails any of it is refused with the reason, said at most once a second (``_say``).
``Mesh`` takes these methods in (a part of one class, in a file of its own): they act on its tables."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from erdma_core.toolkit import HELLO_ACCEPTED, Hello

from .credentials import CredentialError
from .engine import Handshaken
from .mesh_state import REFUSED, Back, Event, Identify, Link, Session, Settings, Ticket
from .streams import Inbound, hello_stream

log = logging.getLogger("erdma.quic")


class Identity:
    """``Mesh``'s identity and HELLO methods (see the module's docstring)."""

    s: Settings
    identify: Identify
    inbound_for: Callable[[int], Inbound]
    links: dict[int, Link]
    refusals: deque[str]
    _events: deque[Event]
    _now: float
    _tickets: dict[bytes, tuple[Ticket, int]]
    _quiet_until: float
    _unsaid: int

    def _fetch_ticket(self, s: Session, label: bytes) -> Ticket | None:
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

    def _keep_ticket(self, ticket: Ticket, rank: int) -> None:
        """Listener (aioquic, whose tickets say their label): ``ticket`` went to ``rank``; it replaces the one
        that rank held."""
        self._tickets = {k: v for k, v in self._tickets.items() if v[1] != rank}
        self._tickets[ticket.ticket] = (ticket, rank)

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

    def _handshake_done(self, s: Session, ev: Handshaken) -> None:
        if s.dialled and s.probe:
            s.established = True
            self._promote(s)
            return
        if s.dialled:
            s.resumed, s.established = ev.resumed, True
            if s.link is not None:
                if s.link.ticket is s.offered:  # spent: the listener answered the flight that carried it
                    s.link.ticket = None
                if ev.resumed:
                    s.link.stats["resumed"] += 1
                    s.link.stats["early_data"] += int(ev.early_data)
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

    def _refuse(self, s: Session, why: str) -> None:
        who = f"rank {s.rank}" if s.rank is not None else "a peer"
        self._say("rank %d: refused the QUIC connection of %s at %s: %s", self.s.rank, who, s.addr, why)
        if not s.dialled:
            self.refusals.append(f"{who} at {s.addr[0]}:{s.addr[1]}: {why}")
        s.failure = why
        s.conn.close(REFUSED, why[:200])
        self._touch(s)

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
