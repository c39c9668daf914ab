"""``SocketTransport``: a message transport over connected stream sockets (TCP, Unix), one per pair of
ranks. A subclass says how to listen and how to dial; this module does the rest: higher ranks dial lower
ranks, a HELLO carrying the job id and both ranks is checked before a connection is used, a reader thread
per connection feeds a ``StreamReader`` (payloads land in the receiver's memory), and frames are written
by the caller under a per-connection lock, in slices, so every write has a bounded wait.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from ..errors import CollectiveTimeoutError, ErdmaError, ProtocolError
from .base import MessageTransport, TransportContext
from .frames import StreamReader
from .mailbox import Request
from .sockets import recv_exact
from .wire import HELLO, HELLO_ACCEPTED, HELLO_REJECTED, HELLO_REQUEST, Header, Hello

log = logging.getLogger("erdma.transport")
POLL = 1.0  # seconds a socket call may block before deadlines and shutdown are looked at again
_SLICE = 4 << 20
_INLINE = 65536  # payloads up to this size leave in one write with their header


class _Conn:
    __slots__ = ("lock", "peer", "reader", "sock")

    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer, self.sock = peer, sock
        self.lock = threading.Lock()
        self.reader: threading.Thread | None = None


class SocketTransport(MessageTransport):
    """Subclasses implement ``listen(ctx) -> (listening socket, address peers dial)`` and
    ``dial(address, deadline) -> connected socket`` (retrying until ``deadline``; ``sockets.dial`` does
    for TCP), and may override ``tune(sock)``. ``key`` names the store entries that publish addresses."""

    key = "stream"

    def __init__(self) -> None:
        super().__init__()
        self.conns: dict[int, _Conn] = {}

    def listen(self, ctx: TransportContext) -> tuple[socket.socket, str]:
        raise NotImplementedError

    def dial(self, address: str, deadline: float) -> socket.socket:
        raise NotImplementedError

    def tune(self, sock: socket.socket) -> None:
        """Set socket options on every connection (nothing by default)."""

    # ---- set-up -------------------------------------------------------------------------------------
    def open(self, ctx: TransportContext) -> None:
        listener, address = self.listen(ctx)
        ctx.store.set(f"{self.key}/addr/{self.rank}", address.encode())
        deadline = time.monotonic() + ctx.connect_timeout
        accepted: dict[int, socket.socket] = {}
        acceptor = threading.Thread(target=self._accept_all, args=(listener, accepted, deadline),
                                    name=f"erdma-accept-{self.rank}", daemon=True)
        acceptor.start()
        try:
            for peer in range(self.rank):
                addr = ctx.store.get(f"{self.key}/addr/{peer}", max(0.01, deadline - time.monotonic())).decode()
                self._add(peer, self._dial_peer(peer, addr, deadline))
            acceptor.join(max(0.0, deadline - time.monotonic()) + POLL)
        finally:
            listener.close()
        for peer, sock in accepted.items():
            self._add(peer, sock)
        missing = [p for p in range(self.rank + 1, self.world_size) if p not in accepted]
        if missing:
            raise CollectiveTimeoutError(f"rank {self.rank}: ranks {missing} did not connect within "
                                         f"{ctx.connect_timeout:.1f}s", rank=self.rank, op="connect")
        for conn in self.conns.values():
            conn.reader = threading.Thread(target=self._read_loop, args=(conn,), daemon=True,
                                           name=f"erdma-rx-{self.rank}<-{conn.peer}")
            conn.reader.start()

    def _dial_peer(self, peer: int, addr: str, deadline: float) -> socket.socket:
        try:
            sock = self.dial(addr, deadline)
        except OSError as exc:
            raise CollectiveTimeoutError(f"rank {self.rank}: cannot connect to rank {peer} at {addr}: {exc}",
                                         rank=self.rank, op="connect") from None
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

    def _accept_all(self, listener: socket.socket, accepted: dict[int, socket.socket], deadline: float) -> None:
        expected = set(range(self.rank + 1, self.world_size))
        while expected - accepted.keys() and time.monotonic() < deadline and not self.closing:
            listener.settimeout(min(POLL, max(0.01, deadline - time.monotonic())))
            try:
                sock, where = listener.accept()
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
        self.conns[peer] = _Conn(peer, sock)

    # ---- sending ------------------------------------------------------------------------------------
    def post(self, peer: int, header: Header, payload: memoryview, deadline: float, req: Request,
             urgent: bool = False) -> None:
        conn = self.conns.get(peer)
        if conn is None:
            req.complete(ErdmaError(f"rank {self.rank}: no connection to rank {peer}"))
            return
        if not conn.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            req.complete(CollectiveTimeoutError(f"rank {self.rank}: sending to rank {peer} waited for the "
                                                "connection past the timeout", rank=self.rank))
            return
        try:
            if header.nbytes <= _INLINE:
                self._write(conn, memoryview(header.pack() + bytes(payload)), deadline, urgent)
            else:
                self._write(conn, memoryview(header.pack()), deadline, urgent)
                self._write(conn, payload, deadline, urgent)
        except ErdmaError as exc:
            req.complete(exc)
            return
        finally:
            conn.lock.release()
        req.complete()

    def _write(self, conn: _Conn, view: memoryview, deadline: float, urgent: bool) -> None:
        sent, n = 0, len(view)
        while sent < n:
            try:
                sent += conn.sock.send(view[sent:sent + _SLICE])
            except TimeoutError:
                if not urgent and self.mailbox.aborted is not None:
                    raise self.mailbox.aborted from None
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(f"rank {self.rank}: sending to rank {conn.peer} made no progress "
                                                 "before the timeout", rank=self.rank) from None
            except OSError as exc:
                raise self.peer_lost(conn.peer, exc) from None

    # ---- receiving ----------------------------------------------------------------------------------
    def _read_loop(self, conn: _Conn) -> None:
        reader = StreamReader(self.inbox(conn.peer))
        try:
            while not self.closing:
                try:
                    k = conn.sock.recv_into(reader.buffer())
                except TimeoutError:
                    continue
                if k == 0:
                    if not self.closing and not self.inbox(conn.peer).closed_cleanly:
                        self.peer_lost(conn.peer, "it closed the connection" if reader.between_frames else
                                       "the connection closed in the middle of a frame")
                    return
                reader.advance(k)
        except ProtocolError as exc:
            log.error("rank %d: protocol error from rank %d: %s", self.rank, conn.peer, exc)
            self.peer_lost(conn.peer, f"it broke the protocol: {exc}")
        except OSError as exc:
            self.peer_lost(conn.peer, exc)

    # ---- shutdown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        for conn in self.conns.values():
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for conn in self.conns.values():
            if conn.reader is not None and conn.reader is not threading.current_thread():
                conn.reader.join(POLL * 2)
            conn.sock.close()
