"""Accepting the ranks that dial this one, during set-up: many handshakes at once on one thread, each
bounded in time and the number of them bounded, so that an idle, slow or hostile connection cannot keep a
rank of the job out. Each connection runs ``auth.Accepting`` (sans-IO) over its own buffer."""

from __future__ import annotations

import logging
import select
import socket
import time
from collections import deque
from collections.abc import Callable

from ..errors import ProtocolError
from . import auth

log = logging.getLogger("erdma.transport")
HANDSHAKE_S = 5.0  # seconds a connection may take to finish its handshake
MAX_PENDING = 64  # handshakes under way at once; the oldest is dropped to make room for a new one
POLL = 0.2


class _Pending:
    __slots__ = ("buf", "deadline", "hs", "where")

    def __init__(self, hs: auth.Accepting, deadline: float, where: str) -> None:
        self.hs, self.deadline, self.where, self.buf = hs, deadline, where, bytearray()


class Acceptor:
    """Accepts until every rank above ``rank`` has proved itself (``accepted``: rank -> socket), ``deadline``
    passes or ``stop`` is set. ``refused`` lists why connections were turned away; ``duplicates`` the ranks
    that two holders of the secret claimed. ``tune(sock)`` is applied to every accepted socket."""

    def __init__(self, listeners: list[socket.socket], deadline: float, *, key: bytes, job: int, rank: int,
                 world: int, tune: Callable[[socket.socket], None]) -> None:
        self.listeners, self.deadline = listeners, deadline
        self.key, self.job, self.rank, self.world, self.tune = key, job, rank, world, tune
        self.accepted: dict[int, socket.socket] = {}
        self.transcripts: dict[int, bytes] = {}  # what each accepted rank's proof covered
        self.refused: deque[str] = deque(maxlen=8)  # the latest reasons, for the set-up error
        self.duplicates: set[int] = set()
        self.stop = False
        self._pending: dict[socket.socket, _Pending] = {}
        for listener in listeners:
            listener.setblocking(False)

    def _claim(self, rank: int) -> int | None:
        return auth.DUPLICATE_RANK if rank in self.accepted else None

    def run(self) -> None:
        expected = set(range(self.rank + 1, self.world))
        try:
            while expected - self.accepted.keys() and not self.stop:
                now = time.monotonic()
                if now >= self.deadline:
                    return
                for sock in [s for s, p in self._pending.items() if p.deadline <= now]:
                    self._drop(sock, f"did not finish its handshake within {HANDSHAKE_S:.0f}s")
                wait = min(POLL, self.deadline - now, *(p.deadline - now for p in self._pending.values()))
                try:
                    ready, _, _ = select.select([*self.listeners, *self._pending], [], [], max(0.0, wait))
                except (OSError, ValueError):
                    return  # a listener was closed: set-up is over
                for sock in ready:
                    if sock in self._pending:
                        self._read(sock)
                    else:
                        self._accept(sock)
        finally:
            for sock in list(self._pending):
                self._drop(sock, "set-up ended first")

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, addr = listener.accept()
        except OSError:  # nothing to accept after all (BlockingIOError), or the listener closed
            return
        if len(self._pending) >= MAX_PENDING:
            oldest = min(self._pending, key=lambda s: self._pending[s].deadline)
            self._drop(oldest, f"{MAX_PENDING} handshakes were under way; dropped the oldest")
        sock.setblocking(False)
        where = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "a local socket"
        hs = auth.Accepting(self.key, self.job, self.rank, self.world, range(self.rank + 1, self.world), self._claim)
        self._pending[sock] = _Pending(hs, min(self.deadline, time.monotonic() + HANDSHAKE_S), where)

    def _read(self, sock: socket.socket) -> None:
        p = self._pending[sock]
        try:
            data = sock.recv(p.hs.need - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(sock, str(exc))
            return
        if not data:
            self._drop(sock, "closed the connection during the handshake")
            return
        p.buf += data
        if len(p.buf) < p.hs.need:
            return
        try:
            reply = p.hs.feed(bytes(p.buf))
            p.buf.clear()
            sock.settimeout(1.0)  # a reply of at most 72 bytes into a new connection's empty buffer
            sock.sendall(reply)
            sock.setblocking(False)
        except (ProtocolError, OSError) as exc:
            self._drop(sock, str(exc))
            return
        if p.hs.need:
            return
        del self._pending[sock]
        rank = p.hs.rank_proven
        if rank is None:
            if p.hs.duplicate:
                self.duplicates.add(p.hs.rank_claimed)
            self._refuse(sock, p.where, p.hs.refused)
            return
        self.tune(sock)
        self.accepted[rank] = sock
        self.transcripts[rank] = p.hs.transcript

    def _drop(self, sock: socket.socket, why: str) -> None:
        p = self._pending.pop(sock)
        self._refuse(sock, p.where, why)

    def _refuse(self, sock: socket.socket, where: str, why: str) -> None:
        msg = f"{where} {why}"
        log.warning("rank %d: refused a connection from %s", self.rank, msg)
        self.refused.append(msg)
        sock.close()
