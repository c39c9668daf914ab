"""The built-in TCP transport: one connection per pair of ranks, payloads received in place.

Higher ranks dial lower ranks; a HELLO carrying the job id and ranks is checked before a connection is
used. Each connection has a reader thread that reads a frame header, asks the mailbox where the payload
goes (the posted receive's memory when it is already waiting) and ``recv_into`` that memory. Sends are
written by the caller under a per-connection lock, in slices, so each write has a bounded wait.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from ..errors import CollectiveError, CollectiveTimeoutError, PeerLostError, ProtocolError
from . import addresses
from .base import TransportContext
from .mailbox import Mailbox, Request
from .sockets import dial, recv_exact
from .wire import (
    ABORT,
    BYE,
    FRAME,
    HELLO,
    HELLO_ACCEPTED,
    HELLO_REJECTED,
    HELLO_REQUEST,
    Header,
    Hello,
    abort_body,
    abort_error,
)

log = logging.getLogger("erdma.tcp")
_POLL = 1.0  # seconds a socket call may block before we look at deadlines and shutdown again
_SLICE = 4 << 20


class _Conn:
    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.send_lock = threading.Lock()
        self.reader: threading.Thread | None = None


class TcpTransport:
    """Factory signature for the registry: ``TcpTransport(config, section)``."""

    devices = frozenset({"cpu"})  # host memory only: CUDA tensors are staged by the front end

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        self.opts = section
        self.rank = -1
        self.world_size = 0
        self.conns: dict[int, _Conn] = {}
        self.mailbox: Mailbox | None = None
        self._closing = False
        self.job = 0

    # ---- set-up -------------------------------------------------------------------------------------
    def connect(self, ctx: TransportContext) -> None:
        self.rank, self.world_size, self.job = ctx.rank, ctx.world_size, ctx.job
        self.mailbox = Mailbox(ctx.rank, ctx.job)
        bind_host, advertised = addresses.choose(self.opts["bind_address"], self.opts["interface"],
                                                 getattr(ctx.store, "host", None))
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind_host, self.opts["port"]))
        listener.listen(max(8, ctx.world_size))
        host, port = advertised, listener.getsockname()[1]
        if ctx.advertise is not None:
            host, port = ctx.advertise(host, port)
        ctx.store.set(f"tcp/addr/{self.rank}", f"{host}:{port}".encode())
        deadline = time.monotonic() + ctx.connect_timeout
        accepted: dict[int, socket.socket] = {}
        acceptor = threading.Thread(target=self._accept_all, args=(listener, accepted, deadline),
                                    name=f"erdma-accept-{self.rank}", daemon=True)
        acceptor.start()
        try:
            for peer in range(self.rank):
                addr = ctx.store.get(f"tcp/addr/{peer}", max(0.01, deadline - time.monotonic())).decode()
                self._add(peer, self._dial(peer, addr, deadline))
            acceptor.join(max(0.0, deadline - time.monotonic()) + _POLL)
        finally:
            listener.close()
        missing = [p for p in range(self.rank + 1, self.world_size) if p not in accepted]
        if missing:
            self.close()
            raise CollectiveTimeoutError(f"rank {self.rank}: ranks {missing} did not connect within "
                                         f"{ctx.connect_timeout:.1f}s", rank=self.rank, op="connect")
        for peer, sock in accepted.items():
            self._add(peer, sock)
        for conn in self.conns.values():
            conn.reader = threading.Thread(target=self._read_loop, args=(conn,), daemon=True,
                                           name=f"erdma-rx-{self.rank}<-{conn.peer}")
            conn.reader.start()

    def _tune(self, sock: socket.socket) -> socket.socket:
        if self.opts["nodelay"]:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.opts["keepalive"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        if self.opts["socket_buffer_bytes"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.opts["socket_buffer_bytes"])
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.opts["socket_buffer_bytes"])
        sock.settimeout(_POLL)
        return sock

    def _dial(self, peer: int, addr: str, deadline: float) -> socket.socket:
        host, port = addr.rsplit(":", 1)
        try:
            sock = dial(host, int(port), deadline)
        except OSError as exc:
            raise CollectiveTimeoutError(f"rank {self.rank}: cannot connect to rank {peer} at {addr}: {exc}",
                                         rank=self.rank, op="connect") from None
        self._tune(sock)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        sock.sendall(Hello(HELLO_REQUEST, self.job, self.rank, self.world_size).pack())
        reply = Hello.parse(recv_exact(sock, HELLO.size))
        if reply.status != HELLO_ACCEPTED or reply.rank != peer:
            sock.close()
            raise ProtocolError(f"rank {self.rank}: rank {peer} at {addr} rejected the connection "
                                f"(job {self.job:#x}; it answered status {reply.status}, rank {reply.rank})")
        sock.settimeout(_POLL)
        return sock

    def _accept_all(self, listener: socket.socket, accepted: dict[int, socket.socket], deadline: float) -> None:
        expected = set(range(self.rank + 1, self.world_size))
        while expected - accepted.keys() and time.monotonic() < deadline and not self._closing:
            listener.settimeout(min(_POLL, max(0.01, deadline - time.monotonic())))
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
                sock.sendall(Hello(HELLO_ACCEPTED if ok else HELLO_REJECTED, self.job, self.rank,
                                   self.world_size).pack())
                if not ok:
                    log.warning("rank %d: rejected a connection from %s: job %#x rank %d world %d (this job %#x, "
                                "world %d)", self.rank, where, hello.job, hello.rank, hello.world, self.job,
                                self.world_size)
                    sock.close()
                    continue
                accepted[hello.rank] = self._tune(sock)
            except (OSError, ProtocolError, ConnectionError) as exc:
                log.warning("rank %d: dropped a connection from %s: %s", self.rank, where, exc)
                sock.close()

    def _add(self, peer: int, sock: socket.socket) -> None:
        self.conns[peer] = _Conn(peer, sock)

    # ---- data path ----------------------------------------------------------------------------------
    def begin(self, group: int, seq: int) -> None:
        assert self.mailbox is not None
        self.mailbox.begin(group, seq)

    def irecv(self, peer: int, header: Header, out: memoryview) -> Request:
        assert self.mailbox is not None
        return self.mailbox.post_recv(peer, header, out)

    def isend(self, peer: int, header: Header, data: memoryview, deadline: float) -> Request:
        assert self.mailbox is not None
        req = Request()
        if self.mailbox.aborted is not None:
            req.complete(self.mailbox.aborted)
            return req
        conn = self.conns[peer]
        try:
            with conn.send_lock:
                if header.nbytes <= 65536:
                    self._write(conn, memoryview(header.pack() + bytes(data)), deadline)
                else:
                    self._write(conn, memoryview(header.pack()), deadline)
                    self._write(conn, data, deadline)
        except CollectiveError as exc:
            req.complete(exc)
            return req
        req.complete()
        return req

    def _write(self, conn: _Conn, view: memoryview, deadline: float) -> None:
        sent, n = 0, len(view)
        while sent < n:
            try:
                sent += conn.sock.send(view[sent:sent + _SLICE])
            except TimeoutError:
                if self.mailbox is not None and self.mailbox.aborted is not None:
                    raise self.mailbox.aborted from None
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(f"rank {self.rank}: sending to rank {conn.peer} made no progress "
                                                 "before the timeout", rank=self.rank) from None
            except OSError as exc:
                err = self._lost(conn.peer, exc)
                raise err from None

    def _lost(self, peer: int, exc: BaseException | str) -> PeerLostError:
        err = PeerLostError(f"rank {self.rank}: lost the connection to rank {peer} ({exc})", peer=peer, rank=self.rank)
        if not self._closing and self.mailbox is not None:
            if self.mailbox.aborted is None:
                log.warning("%s", err)
            self.abort(err)
        return err

    def _read_loop(self, conn: _Conn) -> None:
        assert self.mailbox is not None
        hdr = bytearray(FRAME.size)
        try:
            while not self._closing:
                if not self._read_into(conn, memoryview(hdr), idle_ok=True):
                    return
                h = Header.parse(hdr)
                if h.kind == BYE:  # everything it sent has been read; only receives from it can no longer finish
                    self.mailbox.peer_gone(conn.peer, PeerLostError(
                        f"rank {self.rank}: rank {conn.peer} closed its process group", peer=conn.peer, rank=self.rank))
                    return
                if h.kind == ABORT:
                    payload = bytearray(h.nbytes)
                    self._read_into(conn, memoryview(payload))
                    self.mailbox.abort(abort_error(self.rank, conn.peer, bytes(payload)))
                    continue
                buf, token = self.mailbox.on_header(conn.peer, h)
                if buf is None:
                    self._discard(conn, h.nbytes)
                elif h.nbytes:
                    self._read_into(conn, buf[:h.nbytes])
                self.mailbox.on_payload(token)
        except ProtocolError as exc:
            log.error("rank %d: protocol error from rank %d: %s", self.rank, conn.peer, exc)
            self.abort(PeerLostError(f"rank {self.rank}: rank {conn.peer} broke the protocol: {exc}",
                                     peer=conn.peer, rank=self.rank))
        except (OSError, ConnectionError) as exc:
            self._lost(conn.peer, exc)

    def _read_into(self, conn: _Conn, view: memoryview, idle_ok: bool = False) -> bool:
        got, n = 0, len(view)
        while got < n:
            try:
                k = conn.sock.recv_into(view[got:])
            except TimeoutError:
                if self._closing:
                    return False
                continue
            if k == 0:
                if self._closing:
                    return False
                raise ConnectionError("connection closed by peer" if got or not idle_ok else "peer closed the connection")
            got += k
        return True

    def _discard(self, conn: _Conn, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            self._read_into(conn, scratch[:min(n, len(scratch))])
            n -= min(n, len(scratch))

    # ---- failure and shutdown -------------------------------------------------------------------------
    def abort(self, error: BaseException) -> None:
        """Fail everything pending here and tell every reachable peer why (best effort, bounded)."""
        assert self.mailbox is not None
        first = self.mailbox.aborted is None
        self.mailbox.abort(error)
        if not first or self._closing:
            return
        body = abort_body(error)
        frame = Header(ABORT, 0, 0, 0, self.job, 0, 0, 0, 0, len(body)).pack() + body
        for conn in self.conns.values():
            if conn.peer == getattr(error, "peer", None):
                continue
            if conn.send_lock.acquire(timeout=_POLL):
                try:
                    conn.sock.sendall(frame)
                except OSError:
                    pass
                finally:
                    conn.send_lock.release()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        bye = Header(BYE, 0, 0, 0, self.job, 0, 0, 0, 0, 0).pack()
        for conn in self.conns.values():
            try:
                if conn.send_lock.acquire(timeout=_POLL):
                    try:
                        conn.sock.sendall(bye)
                    finally:
                        conn.send_lock.release()
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for conn in self.conns.values():
            if conn.reader is not None and conn.reader is not threading.current_thread():
                conn.reader.join(_POLL * 2)
            conn.sock.close()

