"""The members' control mesh: a ``registers.Mailbox`` over TCP connections that every member proves on the job's
secret (``mesh_wire``), kept across epochs, so that members decide membership among themselves with no store.

Each member listens on a port of its own and dials a member the first time it has something for it, at the
address ``where(member)`` gives (the job's directory: the DHT, a store). A connection, dialled or accepted,
carries frames both ways; two members that dial each other at once keep both. Sending never blocks the caller:
a message goes to the member's queue (the latest ``QUEUE`` kept) and a thread of the member's link writes it,
dialling first when needed (again after ``RETRY_S``, twice as long each time up to ``RETRY_MAX_S``, while
dials fail). What cannot be sent is dropped: the protocol above repeats itself.

Strangers are bounded: at most ``MAX_PENDING`` accepted connections may be in their handshake at once (one more
closes the one that has waited longest, so a member, whose handshake takes a round trip, gets in past strangers
that only hold connections open), each gets ``HANDSHAKE_S`` to prove itself, a frame longer than ``mesh_wire.MAX_FRAME`` closes
its connection before anything is allocated for it, and the messages waiting for the caller are bounded
(``INBOX`` per channel; more are dropped).

Messages go on numbered channels (``channel(n)``: a mailbox of its own per use, the registers' protocol on
one, the members' signs of life on another); a frame's first byte names its channel. A message for a channel
this member has not opened is dropped.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from ..errors import ErdmaError
from ..net.sockets import close_gently, recv_exact
from . import mesh_wire

log = logging.getLogger("erdma.elastic")
QUEUE = 256  # messages kept for one member while its link is down or busy
INBOX = 4096  # messages received and not yet taken by the caller
MAX_PENDING = 32  # accepted connections in their handshake at once
HANDSHAKE_S = 5.0
DIAL_S = 3.0
SEND_S = 5.0  # a write that makes no progress for this long drops the connection
RETRY_S, RETRY_MAX_S = 0.2, 5.0
IDLE_S = 0.5
FLUSH_S = 2.0  # how long ``close`` waits for what is queued to members it reaches (or dials again)

Where = Callable[[str], "tuple[str, int] | None"]


class _Link:
    """One member's outbound queue and the connection its frames go on."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.queue: deque[bytes] = deque(maxlen=QUEUE)
        self.wake = threading.Event()
        self.retry_s, self.retry_at = RETRY_S, 0.0
        self.gone = False
        self.sending = False  # a frame taken off the queue is being written
        self.thread: threading.Thread | None = None


class _Conn:
    def __init__(self, sock: socket.socket, session: mesh_wire.Session) -> None:
        self.sock, self.session = sock, session
        self.dead = False

    def drop(self) -> None:
        self.dead = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Mesh:
    def __init__(self, secret: bytes, job: str, me: str, where: Where, *, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.me, self.job = me, job
        self._key = mesh_wire.mesh_key(secret)
        self._where = where
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}
        self._conns: set[_Conn] = set()
        self._by_peer: dict[str, _Conn] = {}  # the connection each member's frames go on (dialled or accepted)
        self._pending: deque[socket.socket] = deque()  # accepted connections in their handshake, oldest first
        self._inboxes: dict[int, queue.Queue[tuple[str, bytes]]] = {}
        self._closed = threading.Event()
        self.refused = 0  # accepted connections that did not prove themselves (for tests and logs)
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._listener.settimeout(IDLE_S)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._threads = [threading.Thread(target=self._accept, name=f"erdma-mesh-accept-{me}", daemon=True)]
        self._threads[0].start()

    # ---- the mailboxes ------------------------------------------------------------------------------------

    def channel(self, number: int) -> Channel:
        """The mailbox of channel ``number`` (0-255); closing it leaves the mesh open."""
        with self._lock:
            self._inboxes.setdefault(number, queue.Queue(INBOX))
        return Channel(self, number)

    def send(self, to: str, data: bytes, channel: int = 0) -> None:
        if self._closed.is_set():
            return
        data = bytes([channel]) + data
        if to == self.me:
            self._deliver(to, data)
            return
        with self._lock:
            link = self._links.get(to)
            if link is None:
                link = self._links[to] = _Link(to)
                link.thread = threading.Thread(target=self._write, args=(link,), name=f"erdma-mesh-{to}", daemon=True)
                link.thread.start()
        link.queue.append(data)
        link.wake.set()

    def recv(self, timeout: float, channel: int = 0) -> tuple[str, bytes] | None:
        with self._lock:
            inbox = self._inboxes.setdefault(channel, queue.Queue(INBOX))  # (opens it)
        try:
            return inbox.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def forget(self, peer: str) -> None:
        """Stop keeping a link to ``peer`` (it left the job): its queue is dropped and its connection closed."""
        with self._lock:
            link = self._links.pop(peer, None)
            conn = self._by_peer.pop(peer, None)
        if link is not None:
            link.gone = True
            link.wake.set()
        if conn is not None:
            conn.drop()

    def connected(self) -> set[str]:
        """The members this one holds a live connection to."""
        with self._lock:
            return {p for p, conn in self._by_peer.items() if not conn.dead}

    def close(self) -> None:
        """Send what is queued for members this one reaches (a live connection, or one dialled again after at
        most one failed dial; not a member long gone) for at most ``FLUSH_S``: the last decisions' messages,
        which members still deciding wait for. Then close every connection and thread."""
        end = time.monotonic() + FLUSH_S
        while time.monotonic() < end and not self._closed.is_set():
            with self._lock:
                busy = [link for p, link in self._links.items() if (link.queue or link.sending) and (
                    (p in self._by_peer and not self._by_peer[p].dead) or link.retry_s <= 2 * RETRY_S)]
            if not busy:
                break
            time.sleep(0.02)
        self._closed.set()
        self._listener.close()
        with self._lock:
            links, conns, pending = list(self._links.values()), list(self._conns), list(self._pending)
        for link in links:
            link.wake.set()
        for conn in conns:
            conn.drop()
        for sock in pending:  # strangers in their handshake: their greeting threads end at once
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads + [link.thread for link in links if link.thread is not None]:
            if t is not threading.current_thread():
                t.join(IDLE_S + 1.0)

    # ---- threads ------------------------------------------------------------------------------------------

    def _deliver(self, peer: str, data: bytes) -> None:
        inbox = self._inboxes.get(data[0]) if data else None
        if inbox is None:
            log.debug("elastic mesh: %s's message on a channel nobody reads dropped", peer)
            return
        try:
            inbox.put_nowait((peer, data[1:]))
        except queue.Full:
            log.debug("elastic mesh: %s's message dropped (inbox full)", peer)

    def _write(self, link: _Link) -> None:
        while not self._closed.is_set() and not link.gone:
            link.wake.wait(IDLE_S)
            link.wake.clear()
            while link.queue and not self._closed.is_set() and not link.gone:
                with self._lock:
                    conn = self._by_peer.get(link.peer)
                if conn is None or conn.dead:
                    now = time.monotonic()
                    if now < link.retry_at:
                        self._closed.wait(link.retry_at - now)
                        continue
                    conn = self._dial(link)
                    if conn is None:
                        link.retry_at = time.monotonic() + link.retry_s
                        link.retry_s = min(2 * link.retry_s, RETRY_MAX_S)
                        continue
                try:
                    link.sending = True
                    data = link.queue.popleft()
                except IndexError:
                    link.sending = False
                    break
                try:
                    conn.sock.sendall(conn.session.seal(data))
                except OSError as exc:
                    log.debug("elastic mesh: the connection to %s broke: %s", link.peer, exc)
                    conn.drop()
                finally:
                    link.sending = False

    def _dial(self, link: _Link) -> _Conn | None:
        addr = self._where(link.peer)
        if addr is None:
            return None
        hs = mesh_wire.Dialling(self._key, self.job, self.me, link.peer)
        try:
            sock = socket.create_connection(addr, timeout=DIAL_S)
        except OSError as exc:
            log.debug("elastic mesh: dialling %s at %s failed: %s", link.peer, addr, exc)
            return None
        try:
            sock.settimeout(HANDSHAKE_S)
            sock.sendall(hs.hello())
            sock.sendall(hs.on_challenge(recv_exact(sock, hs.CHALLENGE)))
        except (OSError, ErdmaError) as exc:
            log.warning("elastic mesh: member %s at %s:%d refused: %s", link.peer, addr[0], addr[1], exc)
            close_gently(sock)
            return None
        assert hs.session is not None
        conn = self._adopt(link.peer, sock, hs.session, dialled=True)
        link.retry_s = RETRY_S
        return conn

    def _adopt(self, peer: str, sock: socket.socket, session: mesh_wire.Session, dialled: bool) -> _Conn:
        sock.settimeout(SEND_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small messages, each awaited: no Nagle
        conn = _Conn(sock, session)
        with self._lock:
            self._conns.add(conn)
            held = self._by_peer.get(peer)
            used = dialled or held is None or held.dead
            if used:
                self._by_peer[peer] = conn
        log.debug("elastic mesh: a connection %s %s (%s)", "to" if dialled else "from", peer,
                  "used" if used else "kept beside the one in use")
        reader = threading.Thread(target=self._read, args=(peer, conn, mesh_wire.FrameReader(session)),
                                  name=f"erdma-mesh-read-{peer}", daemon=True)
        reader.start()
        return conn

    def _read(self, peer: str, conn: _Conn, frames: mesh_wire.FrameReader) -> None:
        try:
            while not conn.dead:  # (the socket keeps its SEND_S timeout, for the writer: an idle read goes on)
                try:
                    data = conn.sock.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    break
                for payload in frames.feed(data):
                    self._deliver(peer, payload)
        except (OSError, ErdmaError) as exc:
            if not conn.dead and not self._closed.is_set():
                log.info("elastic mesh: the connection with %s dropped: %s", peer, exc)
        finally:
            conn.drop()
            with self._lock:
                self._conns.discard(conn)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # closed; or out of descriptors, an aborted connection: try again shortly
                if self._closed.is_set():
                    return
                log.warning("elastic mesh: accepting a connection failed: %s", exc)
                self._closed.wait(0.1)
                continue
            with self._lock:
                oldest = self._pending.popleft() if len(self._pending) >= MAX_PENDING else None
                self._pending.append(sock)
            if oldest is not None:
                try:
                    oldest.shutdown(socket.SHUT_RDWR)  # its handshake fails at once and counts it refused
                except OSError:
                    pass
            threading.Thread(target=self._greet, args=(sock,), name=f"erdma-mesh-greet-{self.me}", daemon=True).start()

    def _greet(self, sock: socket.socket) -> None:
        """An accepted connection's handshake, within HANDSHAKE_S; then it is read like a dialled one."""
        hs = mesh_wire.Accepting(self._key, self.job, self.me)
        try:
            sock.settimeout(HANDSHAKE_S)
            deadline = time.monotonic() + HANDSHAKE_S
            head = b""
            while (size := hs.hello_size(head)) is None or len(head) < size:
                if time.monotonic() > deadline:
                    raise TimeoutError("no hello in time")
                more = sock.recv(256)
                if not more:
                    raise ConnectionError("closed during the hello")
                head += more
            if len(head) != size:
                raise ConnectionError("bytes after the hello before the challenge")
            sock.sendall(hs.on_hello(head))
            hs.on_proof(recv_exact(sock, hs.PROOF))
        except (OSError, ErdmaError) as exc:
            self.refused += 1
            log.info("elastic mesh: a connection to %s refused: %s", self.me, exc)
            sock.close()
            return
        finally:
            with self._lock:
                if sock in self._pending:
                    self._pending.remove(sock)
        assert hs.session is not None
        if self._closed.is_set():
            sock.close()
            return
        self._adopt(hs.peer, sock, hs.session, dialled=False)


class Channel:
    """One channel of a mesh, as a ``registers.Mailbox``."""

    def __init__(self, mesh: Mesh, number: int) -> None:
        self._mesh, self.number = mesh, number

    def send(self, to: str, data: bytes) -> None:
        self._mesh.send(to, data, self.number)

    def recv(self, timeout: float) -> tuple[str, bytes] | None:
        return self._mesh.recv(timeout, self.number)

    def close(self) -> None:
        pass
