"""Accepting connections that must prove themselves first: many handshakes at once on one thread, the whole
of each bounded in time and their number bounded in all and per source address (``admission``), so that an
idle, slow or hostile connection, or a flood of them, cannot keep a rank of the job out. ``Gate`` runs any
sans-IO handshake over it (the transports' ``auth.Accepting``, the store's ``auth.StoreServer``)."""

from __future__ import annotations

import errno
import logging
import math
import selectors
import socket
import time
from collections.abc import Callable
from typing import Protocol

from ..errors import ProtocolError
from ..net.sockets import close_gently
from .admission import HANDSHAKE_S, Admission, Refusals

MAX_PENDING = 512  # handshakes under way at once (each a file descriptor: well below the usual limit of 1024)
PER_SOURCE = 16  # of them from one address (a host's ranks dial at once; more are refused and dial again)
POLL = 0.2
_BATCH = 64  # connections taken from a listener's queue per turn


class Handshake(Protocol):
    """A sans-IO handshake: ``need`` bytes wanted next (0: it has ended); ``feed`` takes exactly that many
    and returns the reply to send."""

    need: int

    def feed(self, data: bytes) -> bytes: ...


Divert = Callable[[socket.socket, tuple[str, int]], bool]  # takes an accepted connection elsewhere (True), or not


class _Pending:
    __slots__ = ("buf", "hs", "where")

    def __init__(self, hs: Handshake, where: str) -> None:
        self.hs, self.where, self.buf = hs, where, bytearray()


class Gate:
    """Connections accepted on ``listeners``, each running the handshake ``start(sock)`` makes, side by side on
    the thread that calls ``run``. Each connection whose handshake ended goes to ``ended(sock, hs, where)``,
    which owns it from then on (``refuse`` closes one and logs why). ``what`` names the server in log lines
    (``log``: where they go). ``divert(sock, (host, port))``, asked first of each accepted TCP connection,
    may take it (True) for a handshake run elsewhere (a meeting's, ``meet``)."""

    def __init__(self, listeners: list[socket.socket], start: Callable[[socket.socket], Handshake],
                 ended: Callable[[socket.socket, Handshake, str], None], *, what: str, log: logging.Logger,
                 limit: int = MAX_PENDING, per_source: int = PER_SOURCE, divert: Divert | None = None) -> None:
        self.listeners, self.start, self.ended, self.log, self.divert = listeners, start, ended, log, divert
        self.admission = Admission(limit, per_source)
        self.refusals = Refusals(what)
        self.stop = False
        self._pending: dict[socket.socket, _Pending] = {}
        self._sel = selectors.DefaultSelector()
        for listener in listeners:
            listener.setblocking(False)
            self._sel.register(listener, selectors.EVENT_READ, None)

    def run(self, until: Callable[[], bool] = lambda: False, deadline: float = math.inf) -> None:
        """Serve until ``stop`` is set, ``until()`` is true or ``deadline`` (``time.monotonic()``) passes."""
        try:
            while not self.stop and not until():
                now = time.monotonic()
                if now >= deadline:
                    return
                for sock in self.admission.expired(now):
                    self._drop(sock, f"did not finish its handshake within {HANDSHAKE_S:.0f}s")  # type: ignore[arg-type]
                wait = min(POLL, deadline - now, (self.admission.deadline() or math.inf) - now)
                try:
                    events = self._sel.select(max(0.0, wait))
                except (OSError, ValueError):
                    return  # a listener was closed: serving is over
                for key, _ in events:
                    if key.data is None:
                        self._accept(key.fileobj)  # type: ignore[arg-type]
                    elif key.fileobj in self._pending:
                        self._read(key.fileobj)  # type: ignore[arg-type]
        finally:
            for sock in list(self._pending):
                self._drop(sock, "serving ended first")
            self._say(self.refusals.flush(time.monotonic()))
            self._sel.close()

    def refuse(self, sock: socket.socket, where: str, why: str) -> None:
        """Count the refusal and close ``sock`` (``where``: its address; ``why``: the reason)."""
        self.log.debug("%s: refused %s: %s", self.refusals.what, where, why)
        self._say(self.refusals.note(where, why, time.monotonic()))
        close_gently(sock)

    def _say(self, line: str | None) -> None:
        if line is not None:
            self.log.warning("%s", line)

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(_BATCH):
            try:
                sock, addr = listener.accept()
            except OSError as exc:  # nothing more to accept (BlockingIOError), or the listener closed
                if exc.errno in (errno.EMFILE, errno.ENFILE):  # out of descriptors: make room for the next turn
                    stalled = self.admission.oldest()
                    if stalled is not None:
                        self._drop(stalled, "the process ran out of file descriptors")  # type: ignore[arg-type]
                return
            if self.divert is not None and isinstance(addr, tuple) and self.divert(sock, (addr[0], addr[1])):
                continue  # another part of the rank owns it now
            source, where = (addr[0], f"{addr[0]}:{addr[1]}") if isinstance(addr, tuple) else ("local", "a local socket")
            admitted, dropped = self.admission.admit(sock, source, time.monotonic())
            if dropped is not None:
                self._drop(dropped, "stalled in its handshake; dropped for a newcomer")  # type: ignore[arg-type]
            if not admitted:
                full = self.admission.per_source if len(self.admission) < self.admission.limit else None
                self.refuse(sock, where, f"{full} handshakes from its address were under way" if full else
                            f"{self.admission.limit} handshakes were under way")
                continue
            sock.setblocking(False)
            self._pending[sock] = _Pending(self.start(sock), where)
            self._sel.register(sock, selectors.EVENT_READ, True)

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
            if reply and sock.send(reply) < len(reply):  # at most 72 bytes into a new connection's empty buffer
                raise OSError("it did not take the handshake's reply")
        except (ProtocolError, OSError) as exc:
            self._drop(sock, str(exc))
            return
        self.admission.answered(sock, time.monotonic())
        if p.hs.need:
            return
        self._forget(sock)
        self.ended(sock, p.hs, p.where)

    def _forget(self, sock: socket.socket) -> _Pending:
        self.admission.remove(sock)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        return self._pending.pop(sock)

    def _drop(self, sock: socket.socket, why: str) -> None:
        self.refuse(sock, self._forget(sock).where, why)
