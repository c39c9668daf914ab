"""``SocketTransport``: a message transport over connected stream sockets (TCP, Unix), one per pair of
ranks. A subclass says how to listen and how to dial; this module does the rest: higher ranks dial lower
ranks, and a HELLO carrying the job id and both ranks is checked before a connection is used. Bytes then
move on non-blocking sockets driven by the threads that wait for them (``progress``): no reader threads,
no hand-off between threads on the way of a small collective.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time

from ..errors import CollectiveTimeoutError, ErdmaError, ProtocolError
from .base import MessageTransport, TransportContext
from .frames import StreamReader
from .mailbox import Request
from .progress import Channel, Progress
from .sockets import recv_exact
from .wire import HELLO, HELLO_ACCEPTED, HELLO_REJECTED, HELLO_REQUEST, Header, Hello

log = logging.getLogger("erdma.transport")
POLL = 1.0  # seconds a socket call may block before deadlines and shutdown are looked at again


class SocketTransport(MessageTransport):
    """Subclasses implement ``listen(ctx) -> [(listening socket, address peers dial), ...]`` (one or more;
    peers try the addresses in order) and ``dial(address, deadline) -> connected socket`` (retrying until
    ``deadline``; ``sockets.retrying`` helps), or None when that address cannot be reached from here (another
    host's Unix socket), and may override ``tune(sock)`` and set ``spin``. ``key`` names the store entries
    that publish the addresses (no spaces in them)."""

    key = "stream"
    spin = 0.0  # seconds a thread waiting for a message polls before it sleeps (see ``Progress.wait``)

    def __init__(self) -> None:
        super().__init__()
        self.channels: dict[int, Channel] = {}
        self._progress: Progress | None = None

    def listen(self, ctx: TransportContext) -> list[tuple[socket.socket, str]]:
        raise NotImplementedError

    def dial(self, address: str, deadline: float) -> socket.socket | None:
        raise NotImplementedError

    def tune(self, sock: socket.socket) -> None:
        """Set socket options on every connection (nothing by default)."""

    # ---- set-up -------------------------------------------------------------------------------------
    def open(self, ctx: TransportContext) -> None:
        listening = self.listen(ctx)
        ctx.store.set(f"{self.key}/addr/{self.rank}", " ".join(address for _, address in listening).encode())
        deadline = time.monotonic() + ctx.connect_timeout
        accepted: dict[int, socket.socket] = {}
        acceptor = threading.Thread(target=self._accept_all, args=([s for s, _ in listening], accepted, deadline),
                                    name=f"erdma-accept-{self.rank}", daemon=True)
        acceptor.start()
        try:
            for peer in range(self.rank):
                addrs = ctx.store.get(f"{self.key}/addr/{peer}", max(0.01, deadline - time.monotonic())).decode()
                self._add(peer, self._dial_peer(peer, addrs.split(), deadline))
            acceptor.join(max(0.0, deadline - time.monotonic()) + POLL)
        finally:
            for listener, _ in listening:
                listener.close()
        for peer, sock in accepted.items():
            self._add(peer, sock)
        missing = [p for p in range(self.rank + 1, self.world_size) if p not in accepted]
        if missing:
            raise CollectiveTimeoutError(f"rank {self.rank}: ranks {missing} did not connect within "
                                         f"{ctx.connect_timeout:.1f}s", rank=self.rank, op="connect")
        self._progress = Progress(list(self.channels.values()), self._channel_ended, f"erdma-io-{self.rank}",
                                  self.spin)

    def _dial_peer(self, peer: int, addrs: list[str], deadline: float) -> socket.socket:
        sock, addr = None, " ".join(addrs)
        for addr in addrs:
            try:
                sock = self.dial(addr, deadline)
            except OSError as exc:
                raise CollectiveTimeoutError(f"rank {self.rank}: cannot connect to rank {peer} at {addr}: {exc}",
                                             rank=self.rank, op="connect") from None
            if sock is not None:
                break
        if sock is None:
            raise CollectiveTimeoutError(f"rank {self.rank}: none of rank {peer}'s addresses ({' '.join(addrs)}) "
                                         "can be reached from here", rank=self.rank, op="connect")
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            sock.sendall(Hello(status=HELLO_REQUEST, job=self.job, rank=self.rank, world=self.world_size).pack())
            reply = Hello.parse(recv_exact(sock, HELLO.size))
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise CollectiveTimeoutError(f"rank {self.rank}: rank {peer} at {addr} did not answer HELLO: {exc}",
                                         rank=self.rank, op="connect") from None
        if reply.status != HELLO_ACCEPTED or reply.rank != peer:
            sock.close()
            raise ProtocolError(f"rank {self.rank}: rank {peer} at {addr} rejected the connection "
                                f"(job {self.job:#x}; it answered status {reply.status}, rank {reply.rank})")
        self.tune(sock)
        sock.settimeout(POLL)
        return sock

    def _accept_all(self, listeners: list[socket.socket], accepted: dict[int, socket.socket], deadline: float) -> None:
        expected = set(range(self.rank + 1, self.world_size))
        while expected - accepted.keys() and time.monotonic() < deadline and not self.closing:
            try:
                ready, _, _ = select.select(listeners, [], [], min(POLL, max(0.01, deadline - time.monotonic())))
            except (OSError, ValueError):
                return
            if not ready:
                continue
            try:
                ready[0].settimeout(POLL)
                sock, where = ready[0].accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                hello = Hello.parse(recv_exact(sock, HELLO.size))
                ok = hello.job == self.job and hello.world == self.world_size and hello.rank in expected \
                    and hello.rank not in accepted
                sock.sendall(Hello(status=HELLO_ACCEPTED if ok else HELLO_REJECTED, job=self.job, rank=self.rank,
                                   world=self.world_size).pack())
                if not ok:
                    log.warning("rank %d: rejected a connection from %s: job %#x rank %d world %d (this job %#x, "
                                "world %d)", self.rank, where or "?", hello.job, hello.rank, hello.world, self.job,
                                self.world_size)
                    sock.close()
                    continue
                self.tune(sock)
                sock.settimeout(POLL)
                accepted[hello.rank] = sock
            except (OSError, ProtocolError, ConnectionError) as exc:
                log.warning("rank %d: dropped a connection from %s: %s", self.rank, where or "?", exc)
                sock.close()

    def _add(self, peer: int, sock: socket.socket) -> None:
        self.channels[peer] = Channel(peer, sock, StreamReader(self.inbox(peer)))

    # ---- sending and waiting ----------------------------------------------------------------------------
    def post(self, peer: int, header: Header, payload: memoryview, deadline: float, req: Request,
             urgent: bool = False) -> None:
        ch = self.channels.get(peer)
        if ch is None or self._progress is None:
            req.complete(ErdmaError(f"rank {self.rank}: no connection to rank {peer}"))
            return
        self._progress.send(ch, header.pack(), payload, req, urgent)

    def wait(self, req: Request, deadline: float) -> bool:
        if self._progress is None:
            return req.wait(deadline)
        return self._progress.wait(req, deadline)

    def fail_sends(self, error: BaseException) -> None:
        if self._progress is not None:
            self._progress.fail_queued(error)

    def _channel_ended(self, peer: int, why: str, cleanly: bool) -> BaseException | None:
        if cleanly or (self.closing and why == "it closed the connection"):
            return None
        return self.peer_lost(peer, why)

    # ---- shutdown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        for ch in self.channels.values():
            try:
                ch.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            ch.sock.close()
