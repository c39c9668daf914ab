"""Striping: a rank's traffic over several QUIC connections served by worker processes, for when one core
cannot run aioquic fast enough (``transport.quic.workers``).

Lane 0 is the rank's own connection to each peer, on its own event loop; lanes 1..N are ``lane_worker``
processes, each with a UDP socket and one connection to the same lane of every other rank, authenticated
like lane 0 (but not reconnected after an outage: a lost lane fails the peer). A message of several
parts sends part i on lane i mod (N+1); everything else (small messages, HELLO, BYE, ABORT) stays on
lane 0. A worker hands every part it received to its rank whole, and the rank puts it in place through lane
0's ``Inbound`` (the ``land`` callback), so a frame completes when its last part lands, whichever lane
brought it. Payload crosses between processes in ``parcels`` (shared memory). A thread of its own reads
what the workers report.

A worker that dies fails every collective of its rank, naming the lane (``fatal``); a peer's lane that is
lost fails them naming the peer (``lost``), unless the peer had already said BYE on lane 0.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from erdma_core.sdk import CollectiveTimeoutError, ErdmaError, PeerLostError, ProtocolError, Request
from erdma_core.toolkit import addresses

from . import parcels

log = logging.getLogger("erdma.quic")


class Countdown(Request):
    """A send whose parts travel on several lanes: completes ``req`` when all are done, or fails it with the
    first that fails."""

    __slots__ = ("_left", "_lock", "_req")

    def __init__(self, count: int, req: Request) -> None:
        super().__init__()
        self._left, self._req = count, req
        self._lock = threading.Lock()

    def complete(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._left -= 1
            fire = error is not None or self._left <= 0
        if fire:
            super().complete(error)
            self._req.complete(error)


class Worker:
    def __init__(self, lane: int, sock: socket.socket | None = None) -> None:
        """``sock``: the lane's data socket, prepared by the traversal (else the worker binds its own)."""
        self.lane, self.sock = lane, sock
        ours, theirs = socket.socketpair()
        fds = [theirs.fileno()] + ([sock.fileno()] if sock is not None else [])
        self.proc = subprocess.Popen([sys.executable, "-m", "erdma_quic.lane_worker", *map(str, fds)],
                                     pass_fds=fds, stdin=subprocess.DEVNULL)
        theirs.close()
        self.control = Connection(ours.detach())
        self.write = threading.Lock()
        self.closed = threading.Event()
        self.gone: str | None = None  # why the worker can no longer be used

    def send(self, message: tuple[Any, ...] | dict[str, Any]) -> None:
        with self.write:
            self.control.send(message)

    def expect(self, kind: str, deadline: float) -> tuple[Any, ...]:
        """The next message during set-up, which must be ``kind``."""
        if not self.control.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError
        msg = self.control.recv()
        if msg[0] == "error":
            raise ProtocolError(msg[1])
        if msg[0] != kind:
            raise ProtocolError(f"lane worker sent {msg[0]!r} during set-up, expected {kind!r}")
        return msg


@functools.cache
def _sweep_at_exit() -> None:
    """A rank that exits without closing (an error, ``sys.exit``) still removes its parcels."""
    atexit.register(lambda: parcels.sweep(os.getpid()))


class Lanes:
    """The workers of one rank (``count`` of them) and the parts in flight through them. ``events`` holds the
    three callbacks lane 0 needs to hear of: ``land(peer, head, payload, lane)``, ``lost(peer, why)`` and
    ``fatal(error)``."""

    def __init__(self, count: int, rank: int, world: int, job: int, opts: dict[str, Any],
                 events: dict[str, Callable[..., None]], sockets: list[socket.socket] | None = None) -> None:
        """``sockets``: one data socket per lane, prepared by the traversal (NAT mappings learned), which the
        workers run on and this process punches from; None: each worker binds its own."""
        self.rank, self.world, self.job, self.opts, self.events = rank, world, job, opts, events
        parcels.sweep_dead()  # what ranks on this host left when they were killed
        _sweep_at_exit()
        self.workers = [Worker(k, sockets[k - 1] if sockets else None) for k in range(1, count + 1)]
        self.pending: dict[int, tuple[Request, int]] = {}  # send id -> (request, peer)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stopping = self._closing = False
        self.parts_out = [0] * (count + 1)
        self.parts_in = [0] * (count + 1)
        self._reader: threading.Thread | None = None

    # ---- set-up (on the caller's thread) ---------------------------------------------------------------
    def connect(self, ctx: Any, bind_host: str, host: str, deadline: float) -> None:
        """``host``: the address lane 0 listens on; each lane's (host, port) goes through the traversal's
        ``advertise`` like lane 0's, then into the store."""
        try:
            for w in self.workers:
                w.send({"opts": self.opts, "rank": self.rank, "world": self.world, "job": self.job, "lane": w.lane,
                        "bind": bind_host, "owner": os.getpid(), "timeout": max(0.1, deadline - time.monotonic())})
            for w in self.workers:
                _, port = self._step(w, "port", deadline)
                h, p = ctx.advertise(host, port) if ctx.advertise is not None else (host, port)
                ctx.store.set(f"quic/lane/{self.rank}/{w.lane}", f"{h}:{p}".encode())
            for w in self.workers:
                w.send(("peers", {peer: addresses.published(ctx.store, f"quic/lane/{peer}/{w.lane}",
                                                            max(0.01, deadline - time.monotonic()))
                                  for peer in range(self.rank)}))
            self._punch(ctx, deadline)
            for w in self.workers:
                self._step(w, "ready", deadline)
        except BaseException:
            self.stop()
            raise
        self._reader = threading.Thread(target=self._read_reports, name=f"erdma-quic-{self.rank}-lanes", daemon=True)
        self._reader.start()

    def _punch(self, ctx: Any, deadline: float) -> None:
        """From each lane's prepared socket, the traversal's datagram to that lane of every rank that will
        dial it (as lane 0 does), so that this rank's NAT lets those ranks' lanes in."""
        if ctx.punch is None:
            return
        for w in self.workers:
            if w.sock is None:
                continue
            for peer in range(self.rank + 1, self.world):
                addr = addresses.published(ctx.store, f"quic/lane/{peer}/{w.lane}", max(0.01, deadline - time.monotonic()))
                datagram = ctx.punch(*addr)
                if datagram:
                    for _ in range(2):
                        try:
                            w.sock.sendto(datagram, addr)
                        except OSError as exc:  # the set-up's wait for "ready" names what is missing
                            log.debug("rank %d: no hole punched on lane %d towards rank %d: %s", self.rank, w.lane,
                                      peer, exc)

    def _step(self, w: Worker, kind: str, deadline: float) -> tuple[Any, ...]:
        try:
            return w.expect(kind, deadline)
        except TimeoutError:
            raise CollectiveTimeoutError(f"rank {self.rank}: QUIC lane {w.lane} was not {kind} within the connect "
                                         "timeout", rank=self.rank, op="connect") from None
        except (EOFError, OSError):
            raise ProtocolError(f"rank {self.rank}: QUIC lane {w.lane} worker (pid {w.proc.pid}) exited during "
                                f"set-up with code {w.proc.wait(5)}") from None
        except ProtocolError as exc:
            raise ProtocolError(f"rank {self.rank}: QUIC lane {w.lane}: {exc}") from None

    # ---- sending (caller's thread) ---------------------------------------------------------------------
    def send(self, lane: int, peer: int, head: bytes, body: memoryview, req: Request) -> None:
        w = self.workers[lane - 1]
        if w.gone is not None:
            req.complete(self._worker_error(w))
            return
        ident = next(self._ids)
        with self._lock:
            self.pending[ident] = (req, peer)
            self.parts_out[lane] += 1
        try:
            w.send(("send", ident, peer, head, parcels.write(os.getpid(), f"out{lane}", body)))
        except OSError as exc:
            with self._lock:
                self.pending.pop(ident, None)
            req.complete(ProtocolError(f"rank {self.rank}: QUIC lane {lane}: a part for worker (pid {w.proc.pid}) "
                                       f"could not be handed over: {exc}"))

    # ---- what workers report (on the reader thread) ------------------------------------------------------
    def _read_reports(self) -> None:
        live = {w.control: w for w in self.workers}
        while live and not self._stopping:
            for conn in wait(list(live), timeout=0.5):
                w = live[conn]  # type: ignore[index]
                try:
                    while w.control.poll(0):
                        self._report(w, w.control.recv())
                except (EOFError, OSError):
                    del live[conn]  # type: ignore[arg-type]
                    self._worker_ended(w)

    def _report(self, w: Worker, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "part":
            _, peer, head, name = msg
            self.parts_in[w.lane] += 1
            self.events["land"](peer, head, parcels.take(name), w.lane)
        elif kind == "sent":
            _, ident, error = msg
            with self._lock:
                req, peer = self.pending.pop(ident, (None, -1))
            if req is not None:
                req.complete(None if error is None else
                             PeerLostError(f"rank {self.rank}: lost rank {peer} over QUIC: {error}", peer=peer,
                                           rank=self.rank))
        elif kind == "lost":
            _, peer, why = msg
            if not self._closing:
                self.events["lost"](peer, f"lane {w.lane}: {why}")
        elif kind == "closed":
            w.closed.set()

    def _worker_ended(self, w: Worker) -> None:
        w.closed.set()
        if w.gone is not None or self._closing:
            w.gone = w.gone or "closed"
            return
        try:  # the control socket ends as the process does: its exit status follows within moments
            code: int | None = w.proc.wait(0.2)
        except subprocess.TimeoutExpired:
            code = None
        w.gone = f"exited with code {code}" if code is not None else "closed its control socket"
        err = self._worker_error(w)
        log.warning("%s", err)
        self.fail(err)
        self.events["fatal"](err)

    def _worker_error(self, w: Worker) -> ErdmaError:
        return ProtocolError(f"rank {self.rank}: QUIC lane {w.lane} worker (pid {w.proc.pid}) {w.gone}")

    def fail(self, error: BaseException) -> None:
        """Fail every lane send still waiting (the rank is aborting)."""
        with self._lock:
            waiting, self.pending = list(self.pending.values()), {}
        for req, _ in waiting:
            req.complete(error)

    # ---- shutdown (caller's thread) -----------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Let each worker send what it holds (waiting up to ``timeout`` for it to be acknowledged), close its
        connections and exit."""
        self._closing = True
        for w in self.workers:
            if w.gone is None and not w.control.closed:
                try:
                    w.send(("close", timeout))
                except OSError:
                    w.closed.set()
        end = time.monotonic() + timeout
        for w in self.workers:
            w.closed.wait(max(0.0, end - time.monotonic()))
        self.stop()

    def stop(self) -> None:
        """End the workers (closing their control socket ends one that is still running) and sweep."""
        self._stopping = self._closing = True
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(2.0)
        for w in self.workers:
            w.gone = w.gone or "closed"
            if not w.control.closed:
                w.control.close()
        for w in self.workers:
            try:
                w.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            if w.sock is not None:
                w.sock.close()  # this process's copy (it punched from it)
        parcels.sweep(os.getpid())
