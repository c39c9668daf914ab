"""What the mesh (``mesh``) keeps and says: its settings, the events it reports, one QUIC connection
(``Session``) and what an endpoint keeps about one peer across connections (``Link``). Data only; the
mesh's modules act on it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from erdma_core.sdk import Request

from .engine import EngineConnection
from .streams import Inbound

REFUSED = 0x0100  # application close code: credentials or HELLO refused
Ticket = Any  # a session ticket the dialler keeps: aioquic's ``SessionTicket``, or the compiled engine's bytes
Configure = Callable[[bool, Any, "int | None", "Ticket | None"], Any]  # -> the engine's settings (``tls.configure``)
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


class Outgoing:
    """One message waiting to be handed to QUIC: its streams, and the request that completes when it has
    them (``done``), or when the peer acknowledged those sent from the caller's memory (``held`` of them
    not yet)."""

    __slots__ = ("done", "held", "parts", "req")

    def __init__(self, parts: list[tuple[bytes, Any]], req: Request) -> None:
        self.parts, self.req, self.done, self.held = parts, req, 0, 0


def answered(datagrams: list[tuple[Any, Any]], addr: Any) -> list[tuple[Any, Any]]:
    """A connection's datagrams, those to its peer's address as ``addr`` (the object its first datagram came
    with, which may say how it came: a TURN relay's ``Via``, answered through that relay) rather than as the
    engine rebuilt it. So each connection is answered the way it came, though two come from one address (a
    peer's direct check and its check through this rank's relay)."""
    return [(d, addr if to == addr else to) for d, to in datagrams]


class Session:
    """One QUIC connection."""

    def __init__(self, rank: int | None, addr: Any, dialled: bool) -> None:
        self.conn: EngineConnection = None  # type: ignore[assignment]  # set right after
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
        self.issued: Ticket | None = None  # listener: a ticket issued before the peer was identified


class Link:
    """What an endpoint keeps about one peer across connections: the queue, the parts handed to QUIC and
    not yet acknowledged (numbered, kept for a resend when ``keep``), the incoming side, the listener's
    latest session ticket, and the reconnection state."""

    def __init__(self, rank: int, addr: Any, dialler: bool, inbound: Inbound, keep: bool) -> None:
        self.rank, self.addr, self.dialler, self.inbound, self.keep = rank, addr, dialler, inbound, keep
        self.session: Session | None = None  # the connection now carrying the link
        self.queue: deque[Outgoing] = deque()
        self.unacked: dict[int, tuple[bytes, Any]] = {}  # part number -> (prefix and header, payload)
        self.held: dict[int, Outgoing] = {}  # part number -> its message, sent from the caller's memory
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
