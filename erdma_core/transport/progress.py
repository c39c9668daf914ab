"""Moving bytes on connected, non-blocking stream sockets without handing work between threads.

A thread that waits for a request drives the sockets itself (``Progress.wait``): it writes what is queued,
reads what has arrived (straight into the receiver's memory, through each channel's ``StreamReader``) and
completes requests, its own among them, so a blocking collective never waits for another thread to wake it.
Only one thread drives at a time; another one that waits meanwhile lets the driver complete its request. A
frame is written at once by the thread that posts it when the socket takes it (small frames always do); what
does not fit waits for a driver. A background thread drives only when nobody has for a while, so data that
arrives between collectives is still read (a peer's send completes; an ABORT is heard); while collectives
run it sleeps, so that it is not woken by every message too.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from ..errors import PeerLostError, ProtocolError
from .frames import StreamReader
from .mailbox import Request

POLL = 0.2  # seconds a driver sleeps in select before it looks at its deadline again
QUIET = 0.05  # seconds without a driver before the background thread watches the sockets itself


class _Out:
    """One frame being written: what is left of it, and the request that completes when it is all out."""

    __slots__ = ("req", "started", "views")

    def __init__(self, views: list[memoryview], req: Request | None) -> None:
        self.views, self.req, self.started = views, req, False


class Channel:
    """One connected socket to ``peer``: frames out in order, frames in through ``reader``."""

    __slots__ = ("dead", "lock", "out", "peer", "reader", "sock")

    def __init__(self, peer: int, sock: socket.socket, reader: StreamReader) -> None:
        self.peer, self.sock, self.reader = peer, sock, reader
        sock.setblocking(False)
        self.out: deque[_Out] = deque()
        self.lock = threading.RLock()
        self.dead = False


class Progress:
    def __init__(self, channels: list[Channel], lost: Callable[[int, str, bool], BaseException | None],
                 name: str) -> None:
        """``lost(peer, why, cleanly)``: a channel ended (``cleanly``: after the peer's BYE and all it
        announced); returns the error its queued frames fail with (None: nothing to report)."""
        self.channels = channels
        self._lost = lost
        self._drive = threading.Lock()
        self._driving = False
        self._last_driven = 0.0
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._background = threading.Thread(target=self._run_background, name=name, daemon=True)
        self._background.start()

    # ---- sending ---------------------------------------------------------------------------------------
    def send(self, ch: Channel, views: list[memoryview], req: Request | None, urgent: bool = False) -> None:
        """Queue a frame (its pieces in order); ``req`` completes once it is all written. Written at once
        as far as the socket takes it."""
        with ch.lock:
            if ch.dead:
                if req is not None:
                    req.complete(PeerLostError(f"rank {ch.peer}'s connection is closed", peer=ch.peer))
                return
            item = _Out([v for v in views if len(v)], req)
            if urgent and ch.out:
                ch.out.insert(1 if ch.out[0].started else 0, item)
            else:
                ch.out.append(item)
            failed = self._flush(ch) if ch.out[0] is item else None
            left = bool(ch.out)
        if failed is not None:
            self._end(ch, failed)
        elif left and self._driving:
            self._wake()  # the driver's select does not watch this socket for writing yet

    def _flush(self, ch: Channel) -> str | None:
        """Write queued frames until the socket is full (call with ``ch.lock`` held). Returns why the
        connection failed, for the caller to end it once the lock is released (ending it tells the other
        peers, whose locks another thread may hold while it waits for this one)."""
        while ch.out:
            item = ch.out[0]
            while item.views:
                try:
                    n = ch.sock.sendmsg(item.views)  # header and payload in one call, neither copied
                except (BlockingIOError, InterruptedError):
                    return None
                except OSError as exc:
                    return f"sending failed: {exc}"
                item.started = True
                views = item.views
                while n and views:
                    if n >= len(views[0]):
                        n -= len(views.pop(0))
                    else:
                        views[0] = views[0][n:]
                        n = 0
            ch.out.popleft()
            if item.req is not None:
                item.req.complete()
        return None

    def fail_queued(self, error: BaseException) -> None:
        """Fail every queued frame not yet started (the rank is aborting; an ABORT may follow them)."""
        for ch in self.channels:
            with ch.lock:
                keep = deque(item for item in ch.out if item.started or item.req is None)
                failed = [item for item in ch.out if not (item.started or item.req is None)]
                ch.out = keep
            for item in failed:
                if item.req is not None:
                    item.req.complete(error)

    # ---- driving ---------------------------------------------------------------------------------------
    def wait(self, req: Request, deadline: float) -> bool:
        """Drive the sockets until ``req`` is done (True; raises its error) or ``deadline`` passes (False)."""
        while not req.done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._drive.acquire(blocking=False):
                self._driving = True
                try:
                    self._round(min(left, POLL), req)
                finally:
                    self._driving = False
                    self._last_driven = time.monotonic()
                    self._drive.release()
            else:
                req.settled(min(left, 0.002))  # another thread is driving and completes it
        return req.wait(deadline)

    def _round(self, timeout: float, req: Request | None) -> None:
        """One turn: wait up to ``timeout`` for a socket to be ready (less once ``req`` is done), then read
        and write what is ready. Holds the drive lock."""
        live = [ch for ch in self.channels if not ch.dead]
        if req is not None and req.done():
            return
        reading = [ch.sock for ch in live] + [self._wake_r]
        writing = [ch.sock for ch in live if ch.out]
        try:
            readable, writable, _ = select.select(reading, writing, [], timeout)
        except (OSError, ValueError):  # a socket closed under us: the next turn sees it dead
            return
        by_sock = {ch.sock: ch for ch in live}
        for sock in writable:
            ch = by_sock[sock]
            with ch.lock:
                failed = self._flush(ch)
            if failed is not None:
                self._end(ch, failed)
        for sock in readable:
            if sock == self._wake_r:
                self._drain_wake()
            else:
                self._read(by_sock[sock])

    def _read(self, ch: Channel) -> None:
        reader = ch.reader
        try:
            while not ch.dead:
                buf = reader.buffer()
                try:
                    k = ch.sock.recv_into(buf)
                except (BlockingIOError, InterruptedError):
                    return
                if k == 0:
                    cleanly = reader.inbox.closed_cleanly
                    self._end(ch, "it closed the connection" if reader.between_frames else
                              "the connection closed in the middle of a frame", cleanly)
                    return
                reader.advance(k)
                if k < len(buf):
                    return  # the socket had no more (the next select says when it has)
        except ProtocolError as exc:
            self._end(ch, f"it broke the protocol: {exc}")
        except OSError as exc:
            self._end(ch, str(exc))

    def _end(self, ch: Channel, why: str, cleanly: bool = False) -> None:
        if ch.dead:
            return
        ch.dead = True
        error = self._lost(ch.peer, why, cleanly)
        with ch.lock:
            queued, ch.out = list(ch.out), deque()
        for item in queued:
            if item.req is not None:
                item.req.complete(error or PeerLostError(f"rank {ch.peer}'s connection closed", peer=ch.peer))

    # ---- the background thread -------------------------------------------------------------------------
    def _run_background(self) -> None:
        while not self._stopping:
            if self._driving or time.monotonic() - self._last_driven < QUIET:
                time.sleep(QUIET)  # a collective is driving, or was a moment ago: leave the sockets to it
                continue
            live = [ch for ch in self.channels if not ch.dead]
            try:
                readable, writable, _ = select.select([ch.sock for ch in live] + [self._wake_r],
                                                      [ch.sock for ch in live if ch.out], [], QUIET)
            except (OSError, ValueError):
                time.sleep(QUIET)
                continue
            if self._stopping:
                return
            if (not readable and not writable) or self._driving or not self._drive.acquire(blocking=False):
                continue
            try:
                self._round(0.0, None)
            finally:
                self._last_driven = 0.0  # the background's own turns do not count as a collective driving
                self._drive.release()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        if self._background is not threading.current_thread():
            self._background.join(2 * POLL + 1.0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
