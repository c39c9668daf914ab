"""Moving bytes on connected, non-blocking stream sockets without handing work between threads.

A thread that waits for a request drives the sockets itself (``Progress.wait``): it writes what is queued,
reads what has arrived (straight into the receiver's memory, through each channel's ``StreamReader``) and
completes requests, its own among them, so a blocking collective never waits for another thread to wake it.
It polls without sleeping for the first ``spin`` seconds of a wait (TCP's ``spin_us``), since a small
message answered within microseconds costs less than being put to sleep and woken by the kernel. Only one
thread drives at a time; another one that waits meanwhile lets the driver complete its request. A frame is
written at once by the thread that posts it when the socket takes it (small frames always do); what does
not fit waits for a driver. A background thread drives only when nobody has for a while, so data that
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
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import IntegrityError, PeerLostError, ProtocolError
from ...net.wakeup import WakePipe
from ...security.integrity import SealedFrame, Sealer
from ..frames import StreamReader
from ..request import Request

POLL = 0.2  # seconds a driver sleeps in poll before it looks at its deadline again
QUIET = 0.05  # seconds without a driver before the background thread watches the sockets itself
_READABLE = select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL
_WRITABLE = select.POLLOUT


class _Out:
    """One frame being written: what is left of it (``views``, or a ``SealedFrame`` that tags its payload as
    it goes), and the request that completes when it is all out."""

    __slots__ = ("req", "sealed", "started", "views")

    def __init__(self, views: list[memoryview], req: Request | None, sealed: SealedFrame | None = None) -> None:
        self.views, self.req, self.sealed, self.started = views, req, sealed, False

    def pending(self) -> list[memoryview]:
        return self.views if self.sealed is None else self.sealed.views()

    def wrote(self, n: int) -> bool:
        """``n`` more bytes went out; True once the whole frame has."""
        if self.sealed is None:
            self.views = _after(self.views, n)
            return not self.views
        self.sealed.wrote(n)
        return not self.sealed.left


Frame = Sequence["bytes | memoryview"] | SealedFrame
"""What ``Progress.send`` writes: its parts in order (header, payload, ...), or a ``SealedFrame``."""


def _after(views: list[memoryview], n: int) -> list[memoryview]:
    """What is left of ``views`` once their first ``n`` bytes are written."""
    while n and views:
        if n >= views[0].nbytes:
            n -= views.pop(0).nbytes
        else:
            views[0] = views[0][n:]
            n = 0
    return [v for v in views if v.nbytes]


class Channel:
    """One connected socket to ``peer``: frames out in order, frames in through ``reader``. ``frames``
    counts the data frames handed to it (its BYE says how many); ``seal`` is what seals the frames that
    leave on it, when they are sealed (``integrity.Sealer``)."""

    __slots__ = ("dead", "ended", "fd", "frames", "lock", "out", "peer", "reader", "seal", "sock", "watch_out")

    def __init__(self, peer: int, sock: socket.socket, reader: StreamReader) -> None:
        self.peer, self.sock, self.reader = peer, sock, reader
        sock.setblocking(False)
        self.fd = sock.fileno()
        self.out: deque[_Out] = deque()
        self.lock = threading.RLock()
        self.dead = False
        self.ended: BaseException | None = None  # why, once dead: what every later send on it fails with
        self.watch_out = False  # the driver's poll watches it for room to write (frames wait for it)
        self.frames = 0
        self.seal: Sealer | None = None


class Progress:
    def __init__(self, channels: list[Channel], lost: Callable[[int, str, bool], BaseException | None],
                 corrupt: Callable[[IntegrityError], None], name: str, spin: float = 0.0) -> None:
        """``lost(peer, why, cleanly)``: a channel ended (``cleanly``: after the peer's BYE and all it
        announced); returns the error its queued frames fail with (None: nothing to report).
        ``corrupt(error)``: a frame from ``error.peer`` failed its integrity check (its channel stays open
        for the ABORT that tells the peer; what it reads afterwards is dropped). ``spin``: seconds a waiting
        thread polls before it sleeps."""
        self.channels = channels
        self.spin = spin
        self._lost = lost
        self._corrupt = corrupt
        self._drive = threading.Lock()
        self._driving = False
        self._last_driven = 0.0
        self._stopping = False
        self._wakeup = WakePipe()
        # the driver's poll set (the background thread, which runs without the drive lock, uses select)
        self._poller = select.poll()
        self._by_fd = {ch.fd: ch for ch in channels}
        for ch in channels:
            self._poller.register(ch.fd, _READABLE)
        self._poller.register(self._wakeup.fd, select.POLLIN)
        self._background = threading.Thread(target=self._run_background, name=name, daemon=True)
        self._background.start()

    # ---- sending ---------------------------------------------------------------------------------------
    def send(self, ch: Channel, frame: Frame, req: Request | None, urgent: bool = False) -> None:
        """Send ``frame`` (its parts in order: header, payload, ...); ``req`` completes once it is all written.
        Written at once as far as the socket takes it (small frames always are: the common case, with no
        queueing); the rest waits in the channel's queue for a driver."""
        failed = None
        sealed = frame if isinstance(frame, SealedFrame) else None
        with ch.lock:
            if ch.dead:
                if req is not None:
                    req.complete(ch.ended or PeerLostError(f"rank {ch.peer}'s connection is closed", peer=ch.peer))
                return
            if not ch.out:
                views: Any = frame.views() if sealed is not None else frame  # type: ignore[union-attr]
                try:
                    n = ch.sock.sendmsg(views)  # header and payload in one call, neither copied
                except (BlockingIOError, InterruptedError):
                    n = 0
                except OSError as exc:
                    n, failed = 0, f"sending failed: {exc}"
                if failed is None:
                    item = _Out([] if sealed is not None else [memoryview(v) for v in views], req, sealed)
                    if item.wrote(n):
                        if req is not None:
                            req.complete()
                        return
                    item.started = n > 0
                    ch.out.append(item)
            else:
                item = _Out([] if sealed is not None else _after(list(map(memoryview, frame)), 0), req,  # type: ignore[arg-type]
                            sealed)
                if urgent:
                    ch.out.insert(1 if ch.out[0].started else 0, item)
                else:
                    ch.out.append(item)
            watch = failed is None and not ch.watch_out
            if watch:
                ch.watch_out = True
                self._watch(ch, _READABLE | _WRITABLE)
        if failed is not None:
            error = self._end(ch, failed)
            if req is not None:  # never queued: _end did not see it
                req.complete(error)
        elif watch and self._driving:
            self._wakeup.wake()  # a driver already polling does not watch this socket for writing yet

    def _flush(self, ch: Channel) -> str | None:
        """Write queued frames until the socket is full (call with ``ch.lock`` held). Returns why the
        connection failed, for the caller to end it once the lock is released (ending it tells the other
        peers, whose locks another thread may hold while it waits for this one)."""
        while ch.out:
            item = ch.out[0]
            while True:
                try:
                    n = ch.sock.sendmsg(item.pending())  # header and payload in one call, neither copied
                except (BlockingIOError, InterruptedError):
                    return None
                except OSError as exc:
                    return f"sending failed: {exc}"
                item.started = True
                if item.wrote(n):
                    break
            ch.out.popleft()
            if item.req is not None:
                item.req.complete()
        if ch.watch_out:
            ch.watch_out = False
            self._watch(ch, _READABLE)
        return None

    def _watch(self, ch: Channel, events: int) -> None:
        try:
            self._poller.modify(ch.fd, events)
        except (OSError, KeyError, ValueError):  # closed meanwhile
            pass

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
        """Drive the sockets until ``req`` is done (True; raises its error) or ``deadline`` passes (False).
        For the first ``spin`` seconds the sockets are polled without sleeping (yielding the core to any
        other runnable thread between polls): a thread that sleeps must be woken by the kernel when its
        data comes, which costs more than a small message itself."""
        spin_until = time.monotonic() + self.spin
        while not req.finished:
            if not self._drive.acquire(blocking=False):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                req.settled(min(left, 0.002))  # another thread is driving and completes it
                continue
            self._driving = True
            try:  # drive until the request is done, the deadline passes, or a sleeping poll returns
                while not req.finished:
                    now = time.monotonic()
                    if now >= deadline:
                        break
                    if now < spin_until:
                        if not self._round(0, req):
                            os.sched_yield()
                    else:
                        self._round(min(deadline - now, POLL) * 1000.0, req)
                        break  # let a thread that waits for the lock in between have a turn
            finally:
                self._driving = False
                self._last_driven = time.monotonic()
                self._drive.release()
            if time.monotonic() >= deadline:
                break
        if req.finished and req.error is None:
            return True
        return req.wait(deadline)

    def _round(self, timeout_ms: float, req: Request | None) -> bool:
        """One turn: wait up to ``timeout_ms`` for a socket to be ready (not at all once ``req`` is done),
        then read and write what is ready; True if anything was. Holds the drive lock."""
        if req is not None and req.finished:
            return True
        try:
            ready = self._poller.poll(timeout_ms)
        except (OSError, ValueError):  # a socket closed under us: the next turn sees it dead
            return False
        for fd, events in ready:
            ch = self._by_fd.get(fd)
            if ch is None:
                self._wakeup.drain()
                continue
            if events & _WRITABLE:
                with ch.lock:
                    failed = self._flush(ch)
                if failed is not None:
                    self._end(ch, failed)
            if events & _READABLE:
                self._read(ch)
        return bool(ready)

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
                    return  # the socket had no more (the next poll says when it has)
        except IntegrityError as exc:
            self._corrupt(exc)
        except ProtocolError as exc:
            self._end(ch, f"it broke the protocol: {exc}")
        except OSError as exc:
            self._end(ch, str(exc))

    def _end(self, ch: Channel, why: str, cleanly: bool = False) -> BaseException:
        """The connection to ``ch.peer`` is over: fail what waits to be sent on it. Returns the error."""
        error: BaseException = PeerLostError(f"rank {ch.peer}'s connection closed: {why}", peer=ch.peer)
        if ch.dead:  # another thread ended it first (a reader that heard the peer's ABORT, then its close): its reason
            return ch.ended or error
        ch.dead = True
        try:
            self._poller.unregister(ch.fd)
        except (KeyError, ValueError):
            pass
        error = ch.ended = self._lost(ch.peer, why, cleanly) or error
        with ch.lock:
            queued, ch.out = list(ch.out), deque()
        for item in queued:
            if item.req is not None:
                item.req.complete(error)
        return error

    # ---- the background thread -------------------------------------------------------------------------
    def _run_background(self) -> None:
        while not self._stopping:
            if self._driving or time.monotonic() - self._last_driven < QUIET:
                time.sleep(QUIET)  # a collective is driving, or was a moment ago: leave the sockets to it
                continue
            live = [ch for ch in self.channels if not ch.dead]
            try:
                readable, writable, _ = select.select([ch.sock for ch in live] + [self._wakeup.fd],
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

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.wake()
        if self._background is not threading.current_thread():
            self._background.join(2 * POLL + 1.0)
        self._wakeup.close()
