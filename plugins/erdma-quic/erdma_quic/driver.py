"""A rank's mesh driven by the threads that use it, as the TCP transport drives its sockets (the core's
``erdma_core.transport.stream.progress``): a thread that posts a message builds and sends its packets itself, and a thread that
waits for a request reads the socket, runs the mesh's timers and sends what follows (ACKs, the next packets),
so a small collective never waits for another thread to be scheduled. One thread drives at a time; others
that wait meanwhile let it complete their requests. A background thread takes over when nobody has driven
for a moment (``HANDOVER``), so the handshake, data that arrives between collectives or while a collective
reduces, ACKs, paced packets, keepalives and a lost peer are still handled; while collectives wait it naps.

The mesh is used under one lock, held only while the mesh works (never while a thread sleeps in ``poll``).
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from erdma_core.sdk import Request
from erdma_core.toolkit import WakePipe

from .endpoint import UdpPort
from .mesh import Event, Mesh

POLL = 0.2  # seconds a thread sleeps in poll at most before it looks at its deadline again
# seconds without a driver before the background thread drives: short, because a collective that reduces or
# copies between its waits must not leave a paced sender or a lost packet's resend waiting for it
HANDOVER = 0.002
_IN = select.POLLIN | select.POLLERR


class Driver(UdpPort):
    def __init__(self, sock: socket.socket, mesh: Mesh, on_event: Callable[[Event], None], name: str,
                 gso: bool = False) -> None:
        """``on_event(event)`` runs on whichever thread drives the mesh, under its lock."""
        super().__init__(sock, mesh, on_event, gso)
        self.lock = threading.RLock()  # the mesh's
        self._drive = threading.Lock()  # who reads the socket and sleeps in poll
        self._driving = False
        self._last_driven = 0.0
        self._stopping = False
        self._asleep: dict[str, float] = {}  # "driver", "background": when each, asleep in poll, wakes by itself
        self._wakeup = WakePipe()
        self._pollers = {}
        for who in ("driver", "background"):  # one each: poll() may not run twice at once on one poller
            self._pollers[who] = p = select.poll()
            p.register(sock.fileno(), _IN)
            p.register(self._wakeup.fd, select.POLLIN)
        self._background = threading.Thread(target=self._run_background, name=name, daemon=True)
        self._background.start()

    # ---- what other threads call ---------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the mesh now, on this thread, then send what it gave the mesh to send."""
        self.run_sync(fn, *args)

    def run_sync(self, fn: Callable[..., Any], *args: Any, timeout: float = 5.0) -> Any:
        """Run ``fn(*args)`` on the mesh and return its result; ``timeout``: how long to wait for the lock."""
        if not self.lock.acquire(timeout=timeout):
            raise TimeoutError(f"the QUIC mesh stayed busy for {timeout}s")
        try:
            result = fn(*args)
            self._pump()
        finally:
            self.lock.release()
        return result

    def wait(self, req: Request, deadline: float) -> bool:
        """Drive the mesh until ``req`` is done (True; raises its error) or ``deadline`` passes (False)."""
        first = True
        while not req.done() and not self._stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._drive.acquire(blocking=False):
                self._driving = True
                try:
                    self._turn(min(left, POLL), req, first)
                    first = False
                finally:
                    self._driving = False
                    self._last_driven = time.monotonic()
                    self._drive.release()
            else:
                req.settled(min(left, 0.0005))  # another thread is driving and completes it
        return req.wait(deadline)

    # ---- driving --------------------------------------------------------------------------------------
    def _turn(self, longest: float, req: Request, first: bool) -> None:
        """With the drive lock: work the mesh (on a wait's first turn: the turn before ended with it), and
        unless that finished ``req``, sleep in poll until a datagram, a wake-up, the mesh's timer or
        ``longest`` seconds, then work it again."""
        if first:
            at = self._service()
            if req.done():
                return
        else:
            with self.lock:
                at = self.mesh.get_timer()
        self._sleep("driver", longest, at)
        self._service()

    def _sleep(self, who: str, longest: float, at: float | None) -> None:
        """Sleep in poll until a datagram, a wake-up, the timer ``at`` or ``longest`` seconds."""
        now = self.now
        until = now + longest if at is None else min(now + longest, at)
        self._asleep[who] = until
        try:
            ready = self._pollers[who].poll(max(0.0, until - now) * 1000.0)
        except (OSError, ValueError, RuntimeError):  # closed under us: the transport is shutting down
            return
        finally:
            self._asleep.pop(who, None)
        if any(fd == self._wakeup.fd for fd, _ in ready):
            self._wakeup.drain()

    def _service(self) -> float | None:
        """Read what arrived, run the timer when due, send; returns when the timer is next due."""
        with self.lock:
            self.read()
            at = self.mesh.get_timer()
            if at is not None and at <= self.now:
                self.mesh.handle_timer(self.now)
            return self._pump()

    def _pump(self) -> float | None:
        """With the mesh's lock: send and report; wake a thread asleep in poll if the mesh's timer is now due
        before it would wake (the sleeper holds no lock, so this thread is another one)."""
        self.flush()
        at = self.mesh.get_timer()
        if at is not None and any(at < until for until in list(self._asleep.values())):
            self._wakeup.wake()
        return at

    # ---- the background thread -------------------------------------------------------------------------
    def _run_background(self) -> None:
        """When no collective has driven the mesh for ``HANDOVER`` seconds: sleep in poll (without the drive
        lock, which a collective may take at any time) until a datagram or the mesh's timer, then work the
        mesh unless a collective drives it by then."""
        while not self._stopping:
            if self._driving or time.monotonic() - self._last_driven < HANDOVER:
                time.sleep(HANDOVER)  # a collective drives, or did a moment ago: the mesh is its
                continue
            with self.lock:
                at = self.mesh.get_timer()
            self._sleep("background", POLL, at)
            if self._stopping or self._driving or not self._drive.acquire(blocking=False):
                continue
            try:
                self._service()
            finally:
                self._drive.release()

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._wakeup.wake()
        if self._background is not threading.current_thread():
            self._background.join(2 * POLL + 1.0)
        self.sock.close()
        self._wakeup.close()
