"""The transports' acceptor during set-up: the job's ranks dial in, each connection runs ``auth.Accepting``
on a ``security.gate.Gate`` (handshakes bounded in time and number), and each proven connection is kept for
its rank and lane."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from ...security import auth
from ...security.gate import Divert, Gate, Handshake

log = logging.getLogger("erdma.transport")


class Acceptor:
    """Accepts until every rank above ``rank`` has proved itself on each of its connections (``accepted``:
    rank -> {lane: socket}; ``complete(rank)``), ``deadline`` passes or ``stop`` is set. Over TCP a pair
    of ranks opens ``lanes`` connections (a pool: ``transport.tcp.connections``), over a Unix socket one;
    a rank that opens another number is refused. ``refused`` lists the latest reasons connections were
    turned away; ``duplicates`` the ranks that two holders of the secret claimed. ``tune(sock)`` is applied
    to every accepted socket; ``divert``: as ``Gate``'s."""

    def __init__(self, listeners: list[socket.socket], deadline: float, *, key: bytes, job: int, rank: int,
                 world: int, tune: Callable[[socket.socket], None], divert: Divert | None = None,
                 lanes: int = 1) -> None:
        self.deadline = deadline
        self.key, self.job, self.rank, self.world, self.tune, self.lanes = key, job, rank, world, tune, lanes
        self.accepted: dict[int, dict[int, socket.socket]] = {}
        self.transcripts: dict[tuple[int, int], bytes] = {}  # (rank, lane) -> what its proof covered
        self.duplicates: set[int] = set()
        self._pools: dict[int, int] = {}  # rank -> connections it opens
        self.gate = Gate(listeners, self._start, self._ended, what=f"rank {rank}", log=log, divert=divert)
        self.refused = self.gate.refusals.latest

    @property
    def stop(self) -> bool:
        return self.gate.stop

    @stop.setter
    def stop(self, value: bool) -> None:
        self.gate.stop = value

    def run(self) -> None:
        """Until every rank above has proved itself, or, with ``divert``, until ``stop``: connections that
        belong to meetings may still arrive."""
        expected = range(self.rank + 1, self.world)
        if self.gate.divert is not None:
            self.gate.run(deadline=self.deadline)
        else:
            self.gate.run(lambda: all(self.complete(r) for r in expected), self.deadline)

    def complete(self, rank: int) -> bool:
        """Whether every connection ``rank`` opens to this one has proved itself."""
        return len(self.accepted.get(rank, ())) == self._pools.get(rank, -1)

    def _start(self, sock: socket.socket) -> auth.Accepting:
        want = 1 if sock.family == socket.AF_UNIX else self.lanes
        return auth.Accepting(self.key, self.job, self.rank, self.world, range(self.rank + 1, self.world),
                              lambda rank, lane, lanes: self._claim(rank, lane, lanes, want))

    def _claim(self, rank: int, lane: int, lanes: int, want: int) -> int | None:
        if lanes != want or self._pools.get(rank, lanes) != lanes:
            return auth.WRONG_LANES
        return auth.DUPLICATE_RANK if lane in self.accepted.get(rank, ()) else None

    def _ended(self, sock: socket.socket, hs: Handshake, where: str) -> None:
        assert isinstance(hs, auth.Accepting)
        rank = hs.rank_proven
        if rank is None:
            if hs.duplicate:
                self.duplicates.add(hs.rank_claimed)
            self.gate.refuse(sock, where, hs.refused)
            return
        self.tune(sock)
        self.accepted.setdefault(rank, {})[hs.lane] = sock
        self._pools[rank] = hs.lanes
        self.transcripts[(rank, hs.lane)] = hs.transcript
