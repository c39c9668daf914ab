"""Two ranks behind NATs meet over TCP: both connect at once, each from the port whose mapping its traversal
learned, to the other's candidates (simultaneous open, RFC 9293 3.5). Each end's outgoing SYN opens its own
NAT to the other end, so the connection forms whichever SYN gets through first: both SYNs cross, or one
reaches the other end's listener on that port (where no NAT filters). Which end then acts as the dialler of
the job's handshake is decided by rank, not by who connected: a listener hands a connection from a lower
rank's published address to that meeting (``SocketTransport``), the rest to its bounded acceptor."""

from __future__ import annotations

import errno
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from .addresses import Candidate

Arrival = Callable[[], "tuple[socket.socket, Candidate] | None"]
TICK = 0.05  # seconds between looks for a connection that arrived otherwise (set-up only)
HELLO_S = 2.0  # a lower rank whose own connection reached a peer's listener waits this long for its handshake
RETRY_S = (0.05, 0.5)  # after a reset (the peer's port is not open yet): first pause, longest pause
_REFUSED = (errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT)


def bound_to(local: tuple[str, int]) -> socket.socket:
    """A TCP socket bound to ``local`` beside the others bound there (the traversal's, other meetings')."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(local)
    except OSError:
        sock.close()
        raise
    return sock


def drop(sock: socket.socket) -> None:
    """Close with a reset, so that no TIME_WAIT keeps this address pair from meeting again."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def attempt(local: tuple[str, int], cand: Candidate, until: float, gave_up: Callable[[], bool],
            arrived: Arrival) -> tuple[socket.socket, Candidate] | None:
    """A connection from ``local`` to ``cand`` (blocking, no timeout set), or one that ``arrived()`` (the
    peer's own, which this rank's listener took), or None at ``until`` or when ``gave_up()``. One SYN stays
    pending while nothing answers (the kernel repeats it; the peer's SYN completes it); a reset (nobody
    there yet) is tried again after a pause."""
    remote = (cand.host, cand.port)
    pause = RETRY_S[0]
    while time.monotonic() < until and not gave_up():
        sock = bound_to(local)
        sock.setblocking(False)
        code = sock.connect_ex(remote)
        while code in (errno.EINPROGRESS, errno.EALREADY) and time.monotonic() < until and not gave_up():
            if select.select([], [sock], [], min(TICK, max(0.0, until - time.monotonic())))[1]:
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            elif (got := arrived()) is not None:
                drop(sock)
                return got
        if code == 0:
            sock.setblocking(True)
            return sock, cand
        drop(sock)
        if code not in _REFUSED and code not in (errno.EINPROGRESS, errno.EALREADY, errno.EADDRNOTAVAIL):
            raise OSError(code, f"{errno.errorcode.get(code, code)} connecting to {remote[0]}:{remote[1]}")
        end = min(until, time.monotonic() + pause)
        while time.monotonic() < end and not gave_up():
            if (got := arrived()) is not None:
                return got
            time.sleep(max(0.0, min(TICK, end - time.monotonic())))
        pause = min(2 * pause, RETRY_S[1])
    return None


def meet(local: tuple[str, int], plan: list[Candidate], wait: float, deadline: float,
         gave_up: Callable[[], bool] = lambda: False,
         arrived: Arrival = lambda: None) -> tuple[socket.socket, Candidate] | None:
    """A connection to the first of ``plan``'s candidates that answers, each tried for ``wait`` seconds in
    turn (the only one until ``deadline``), round after round until ``deadline`` (None then), or one that
    ``arrived()`` meanwhile. Both ends go through the same plan in the same order, so they try the same pair
    of addresses at once."""
    while time.monotonic() < deadline and not gave_up():
        for cand in plan:
            until = deadline if len(plan) == 1 else min(deadline, time.monotonic() + wait)
            got = attempt(local, cand, until, gave_up, arrived)
            if got is not None:
                return got
    return None


class Arrivals:
    """Connections a meeting port's listener took from lower ranks: each is that rank's meeting (this rank, the
    higher, dials it), not one for the acceptor (``divert``, as ``security.gate.Gate`` asks). A connection is a lower
    rank's when it comes from one of its published addresses, or, from a NAT that maps each destination to a
    new port (so from no published port), from a host that only that rank's candidates name once every peer's
    are known (``known``: until then, or where two peers share a host, as on one machine, the acceptor takes it,
    and the lower rank, hearing nothing on it within ``HELLO_S``, connects again). At most one waits per rank;
    an older one is stale and dropped."""

    def __init__(self, peers: int = 0) -> None:
        self._at: dict[tuple[str, int], tuple[int, Candidate]] = {}
        self._waiting: dict[int, list[tuple[socket.socket, Candidate]]] = {}
        self._hosts: dict[str, set[int]] = {}  # candidate host -> the peers whose candidates name it
        self._published: set[tuple[str, int]] = set()  # every known peer's candidates
        self._known: set[int] = set()
        self._peers = peers  # how many peers this rank has: a host is one peer's only once all are known
        self._lock = threading.Lock()

    def expect(self, peer: int, cands: list[Candidate]) -> None:
        """``peer`` (a lower rank) meets from ``cands``."""
        with self._lock:
            self._at.update({(c.host, c.port): (peer, c) for c in cands})
            self._waiting[peer] = []
        self.known(peer, cands)

    def known(self, peer: int, cands: list[Candidate]) -> None:
        """``peer``'s published candidates (any rank), for telling whose host a connection comes from."""
        with self._lock:
            self._known.add(peer)
            for c in cands:
                self._published.add((c.host, c.port))
                if c.kind != "relay":
                    self._hosts.setdefault(c.host, set()).add(peer)

    def _whose(self, source: tuple[str, int]) -> tuple[int, Candidate] | None:
        found = self._at.get(source)
        if found is not None:
            return found
        owners = self._hosts.get(source[0], set())
        if source in self._published or len(self._known) < self._peers or len(owners) != 1:
            return None  # a higher rank's address, or another peer may be behind that host: not this rank's to guess
        (peer,) = owners
        return (peer, Candidate(source[0], source[1], "prflx")) if peer in self._waiting else None

    def divert(self, sock: socket.socket, source: tuple[str, int]) -> bool:
        with self._lock:
            found = self._whose(source)
            if found is None:
                return False
            waiting = self._waiting[found[0]]
            while waiting:
                drop(waiting.pop()[0])
            waiting.append((sock, found[1]))
            return True

    def take(self, peer: int) -> tuple[socket.socket, Candidate] | None:
        """The connection that arrived from ``peer``, once (None if none has)."""
        with self._lock:
            waiting = self._waiting.get(peer)
            return waiting.pop() if waiting else None

    def close(self) -> None:
        """Drop what nobody took."""
        with self._lock:
            for waiting in self._waiting.values():
                while waiting:
                    drop(waiting.pop()[0])
