"""``SocketTransport``: a message transport over connected stream sockets (TCP, Unix), one per pair of
ranks. A subclass says how to listen and how to dial; this module does the rest: higher ranks dial lower
ranks, and a connection is used only once the dialler has proved it knows the job's secret and which rank
it is (``auth``: a mutual challenge-response; ``accept``: many handshakes at once, each bounded in time). Bytes then
move on non-blocking sockets driven by the threads that wait for them (``progress``): no reader threads,
no hand-off between threads on the way of a small collective. Every frame on a connection that leaves the
host is sealed (``integrity``), unless TLS already authenticates its bytes; a Unix socket's never leave
the kernel. Between ranks of one host that may read each other's memory, large messages are lent instead
of written (``single_copy``).
"""

from __future__ import annotations

import fcntl
import logging
import math
import socket
import struct
import termios
import threading
import time

from ..errors import AuthenticationError, CollectiveTimeoutError, ConfigError, ErdmaError, IntegrityError, ProtocolError
from . import auth, integrity, single_copy
from .accept import Acceptor
from .base import MessageTransport, TransportContext, failed_elsewhere
from .frames import StreamReader
from .mailbox import Lent, Request
from .progress import Channel, Progress
from .sockets import recv_exact
from .wire import DATA, LENT, PULL, PULLED, RAW, Header, control

log = logging.getLogger("erdma.transport")
_TCP_INFO_BYTES = 168  # struct tcp_info up to tcpi_delivery_rate (Linux 4.9 and later)
_DELIVERY_RATE = 160  # offset of tcpi_delivery_rate (u64, bytes per second)


def _unacked(sock: socket.socket) -> int:
    """Bytes of ``sock``'s send queue its peer has not acknowledged (unsent ones included)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except OSError:
        return 0


def _name(address: object) -> str:
    """``host:port`` of a socket address."""
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)


def brief(ranks: list[int], shown: int = 8) -> str:
    """A list of ranks for a message, cut short when long."""
    if len(ranks) <= shown:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:shown]))}, ... ({len(ranks)} ranks)]"
POLL = 1.0  # seconds a socket call may block before deadlines and shutdown are looked at again
SETUP_POLL = 0.5  # seconds between looks at the store, during set-up, for a rank that gave up


class SocketTransport(MessageTransport):
    """Subclasses implement ``listen(ctx) -> [(listening socket, address peers dial), ...]`` (one or more;
    peers try the addresses in order) and ``dial(address, deadline) -> connected socket`` (retrying until
    ``deadline``; ``sockets.retrying`` helps), or None when that address cannot be reached from here (another
    host's Unix socket), and may override ``tune(sock)`` and set ``spin``. ``key`` names the store entries
    that publish the addresses (no spaces in them)."""

    key = "stream"
    spin = 0.0  # seconds a thread waiting for a message polls before it sleeps (see ``Progress.wait``)
    tls = False  # TLS over each TCP connection once it is authenticated (``transport.tcp.tls``)
    lend_bytes = 0  # messages of at least this many bytes are lent to a peer that can read them (0: never)

    def __init__(self) -> None:
        super().__init__()
        self.channels: dict[int, Channel] = {}
        self._progress: Progress | None = None
        self._key = b""  # the job's transport key (``auth.job_key``)
        self._seals: dict[int, integrity.Sealer] = {}  # peers whose frames are sealed (``integrity``)
        self._lend_to: frozenset[int] = frozenset()  # peers that read this rank's memory (``single_copy``)
        self._pids: dict[int, int] = {}  # peers whose memory this rank reads, and their processes

    def listen(self, ctx: TransportContext) -> list[tuple[socket.socket, str]]:
        raise NotImplementedError

    def dial(self, address: str, deadline: float) -> socket.socket | None:
        raise NotImplementedError

    def tune(self, sock: socket.socket) -> None:
        """Set socket options on every connection (nothing by default)."""

    # ---- set-up -------------------------------------------------------------------------------------
    def open(self, ctx: TransportContext) -> None:
        listening = self.listen(ctx)
        for _, address in listening:
            auth.warn_if_exposed(address.rsplit(":", 1)[0], ctx.secret, f"rank {self.rank}'s {self.name} transport")
        ctx.store.set(f"{self.key}/addr/{self.rank}", " ".join(address for _, address in listening).encode())
        deadline = time.monotonic() + ctx.connect_timeout
        self._key = auth.job_key(ctx.secret, ctx.job)
        accepting = Acceptor([s for s, _ in listening], deadline, key=self._key, job=self.job, rank=self.rank,
                             world=self.world_size, tune=self.tune)
        acceptor = threading.Thread(target=accepting.run, name=f"erdma-accept-{self.rank}", daemon=True)
        acceptor.start()
        try:
            for peer in range(self.rank):
                addrs = self._address_of(ctx, peer, deadline)
                sock, transcript = self._dial_peer(peer, addrs.split(), deadline)
                self._add(peer, sock, transcript, True, deadline)
            while acceptor.is_alive() and time.monotonic() < deadline:
                acceptor.join(SETUP_POLL)
                self._check_others(ctx)
        finally:
            accepting.stop = True
            acceptor.join(2 * POLL)
            for listener, _ in listening:
                listener.close()
        for peer, sock in accepting.accepted.items():
            self._add(peer, sock, accepting.transcripts[peer], False, deadline)
        if accepting.duplicates:
            raise AuthenticationError(f"rank {self.rank}: two processes proved to be rank(s) "
                                      f"{sorted(accepting.duplicates)} of this job (duplicate rank); "
                                      "each rank must be started once")
        missing = [p for p in range(self.rank + 1, self.world_size) if p not in accepting.accepted]
        if missing:
            refused = "; ".join(list(accepting.refused)[-3:])
            raise CollectiveTimeoutError(f"rank {self.rank}: ranks {brief(missing)} did not connect within "
                                         f"{ctx.connect_timeout:.1f}s" + (f" (refused: {refused})" if refused else ""),
                                         rank=self.rank, op="connect")
        if self.lend_bytes:
            self._probe_single_copy(deadline)
        self._progress = Progress(list(self.channels.values()), self._channel_ended, self._corrupt,
                                  f"erdma-io-{self.rank}", self.spin)

    def _probe_single_copy(self, deadline: float) -> None:
        """Which same-host peers lend and borrow memory (both ends of every Unix socket do this here)."""
        local = single_copy.peers_of((p, ch.sock) for p, ch in self.channels.items())
        if not local:
            return
        try:
            lend_to, self._pids = single_copy.probe(local, deadline)
        except single_copy.Unanswered as exc:
            raise CollectiveTimeoutError(f"rank {self.rank}: set-up of single-copy transfers (probe): {exc}",
                                         rank=self.rank, op="connect") from None
        finally:
            for sock in local.values():
                sock.setblocking(False)
        self._lend_to = frozenset(lend_to)
        if self._pids:
            self.mailbox.pull = self._pull
        log.debug("rank %d: lends to %s, reads from %s", self.rank, sorted(lend_to), sorted(self._pids))

    def _address_of(self, ctx: TransportContext, peer: int, deadline: float) -> str:
        """``peer``'s published addresses, waiting for them (and looking whether a rank gave up meanwhile)."""
        key = f"{self.key}/addr/{peer}"
        while True:
            left = deadline - time.monotonic()
            try:
                return ctx.store.get(key, max(0.01, min(SETUP_POLL, left))).decode()
            except CollectiveTimeoutError:
                self._check_others(ctx)
                if left <= SETUP_POLL:
                    raise

    def _check_others(self, ctx: TransportContext) -> None:
        why = failed_elsewhere(ctx.store, ctx.job)
        if why is not None:
            raise ConfigError(f"rank {self.rank}: set-up stopped: {why}")

    def _dial_peer(self, peer: int, addrs: list[str], deadline: float) -> tuple[socket.socket, bytes]:
        """A connection to ``peer`` that passed the handshake, and the handshake's transcript. A connection
        the peer closed before the handshake ended (its acceptor was full, or dropped it) is dialled again,
        with back-off, until ``deadline``; a refusal is final. An attempt is never given up before
        ``deadline``: the peer may have taken the connection already."""
        delay = 0.02
        while True:
            sock, addr = self._connect(peer, addrs, deadline)
            hs = auth.Dialling(self._key, self.job, self.rank, peer, self.world_size)
            try:
                sock.settimeout(max(0.1, deadline - time.monotonic()))  # never shorter: the peer may have taken it
                sock.sendall(hs.first())
                head = recv_exact(sock, auth.HELLO.size)
                proof = hs.on_challenge(head + (recv_exact(sock, auth.MAC)
                                                if auth.parse_hello(head)[0] == auth.CHALLENGE else b""))
                if proof is not None:
                    sock.sendall(proof)
                    hs.on_verdict(recv_exact(sock, auth.HELLO.size))
            except TimeoutError as exc:
                sock.close()
                raise CollectiveTimeoutError(f"rank {self.rank}: rank {peer} at {addr} did not complete the HELLO "
                                             f"handshake: {exc}", rank=self.rank, op="connect") from None
            except (OSError, ConnectionError) as exc:  # it closed the connection: dropped, dial again
                sock.close()
                if hs.error is not None:
                    raise hs.error from None
                if time.monotonic() + delay >= deadline:
                    raise CollectiveTimeoutError(f"rank {self.rank}: rank {peer} at {addr} did not complete the "
                                                 f"HELLO handshake: {exc}", rank=self.rank, op="connect") from None
                log.debug("rank %d: handshake with rank %d at %s failed (%s); dialling again", self.rank, peer,
                          addr, exc)
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
                continue
            except (ProtocolError, AuthenticationError):
                sock.close()
                raise
            if hs.error is not None:
                sock.close()
                raise hs.error
            self.tune(sock)
            sock.settimeout(POLL)
            return sock, hs.transcript

    def _connect(self, peer: int, addrs: list[str], deadline: float) -> tuple[socket.socket, str]:
        """A connected socket to the first of ``peer``'s addresses reachable from here, and that address."""
        for addr in addrs:
            try:
                sock = self.dial(addr, deadline)
            except OSError as exc:
                raise CollectiveTimeoutError(f"rank {self.rank}: cannot connect to rank {peer} at {addr}: {exc}",
                                             rank=self.rank, op="connect") from None
            if sock is not None:
                return sock, addr
        raise CollectiveTimeoutError(f"rank {self.rank}: none of rank {peer}'s addresses ({' '.join(addrs)}) "
                                     "can be reached from here", rank=self.rank, op="connect")

    def _add(self, peer: int, sock: socket.socket, transcript: bytes, dialled: bool, deadline: float) -> None:
        """Take an authenticated connection to ``peer`` into use: TLS over it when ``self.tls``, else every frame
        on it sealed, unless it is a Unix socket (TLS and seals protect bytes on a path; those never leave the
        kernel)."""
        check = None
        if sock.family != socket.AF_UNIX:
            link = f"{self.name} {_name(sock.getpeername())} -> {_name(sock.getsockname())}"
            if self.tls:
                from . import tls

                sock = tls.secure(sock, server=not dialled, key=self._key, transcript=transcript,  # type: ignore[assignment]
                                  timeout=max(0.1, deadline - time.monotonic()), rank=self.rank, peer=peer)
            else:
                send, receive = integrity.keys(self._key, transcript, dialled)
                self._seals[peer] = integrity.Sealer(send)
                check = integrity.Checker(receive, rank=self.rank, peer=peer, where=link)
        self.channels[peer] = Channel(peer, sock, StreamReader(self.inbox(peer), check))

    # ---- sending and waiting ----------------------------------------------------------------------------
    def link_rate(self, peer: int) -> float | None:
        """Bytes per second the connection to ``peer`` delivers: the kernel's measured delivery rate of TCP
        (``TCP_INFO``), unbounded for a Unix socket (memory on one host); None before it has measured."""
        ch = self.channels.get(peer)
        if ch is None or ch.dead:
            return None
        if ch.sock.family == socket.AF_UNIX:
            return math.inf
        try:
            info = ch.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        except OSError:
            return None
        rate = struct.unpack_from("<Q", info, _DELIVERY_RATE)[0] if len(info) >= _TCP_INFO_BYTES else 0
        return float(rate) or None

    def post(self, peer: int, header: Header, payload: memoryview, deadline: float, req: Request,
             urgent: bool = False) -> None:
        ch = self.channels.get(peer)
        if ch is None or self._progress is None:
            req.complete(ErdmaError(f"rank {self.rank}: no connection to rank {peer}"))
            return
        if (peer in self._lend_to and payload.nbytes >= self.lend_bytes and header.kind == DATA
                and header.codec == RAW and payload.c_contiguous):
            self._lend(ch, header, payload, req)
            return
        seal = self._seals.get(peer)
        if seal is None:
            self._progress.send(ch, (header.pack(), payload), req, urgent)
            return
        head, tail = seal.seal(header.pack(), payload)
        self._progress.send(ch, head if tail is None else (head, payload, tail), req, urgent)  # type: ignore[arg-type]

    def _lend(self, ch: Channel, header: Header, payload: memoryview, req: Request) -> None:
        """Send where ``payload`` lies instead of its bytes; ``req`` completes when the peer has read it."""
        ticket = self.mailbox.lend(ch.peer, req, payload)
        if ticket is None:
            return
        body = LENT.pack(single_copy.address_of(payload), payload.nbytes, ticket)
        assert self._progress is not None
        self._progress.send(ch, (header._replace(kind=PULL, nbytes=LENT.size).pack(), body), None)
        if ch.dead:  # it closed before or while the frame was handed over: nobody will read it
            self.mailbox.fail_lent(ch.peer, ErdmaError(f"rank {self.rank}: no connection to rank {ch.peer}"))

    def _pull(self, peer: int, lent: Lent, out: memoryview | None) -> BaseException | None:
        """Read what ``peer`` lent into ``out`` (None: it is not wanted) and give the peer its memory back."""
        error = None
        if out is not None:
            try:
                single_copy.read(self._pids[peer], lent.address, out)
            except (OSError, KeyError) as exc:
                error = self.peer_lost(peer, f"the message it lent could not be read: {exc!r}")
        ch = self.channels.get(peer)
        if ch is not None and self._progress is not None:
            self._progress.send(ch, (control(PULLED, self.job, seq=lent.ticket).pack(),), None, urgent=True)
        return error

    def wait(self, req: Request, deadline: float) -> bool:
        if self._progress is None:
            return req.wait(deadline)
        return self._progress.wait(req, deadline)

    def fail_sends(self, error: BaseException) -> None:
        if self._progress is not None:
            self._progress.fail_queued(error)

    def _corrupt(self, error: IntegrityError) -> None:
        """A frame failed its check: the job fails everywhere with ``error`` (its sender among the told)."""
        if self.mailbox.aborted is None:
            log.error("%s", error)
        self.abort(error, wait=False)

    def _channel_ended(self, peer: int, why: str, cleanly: bool) -> BaseException | None:
        error = None
        if not (cleanly or (self.closing and why == "it closed the connection")):
            error = self.peer_lost(peer, why)
        if peer in self._lend_to:
            self.mailbox.fail_lent(peer, error or ErdmaError(f"rank {self.rank}: rank {peer} closed its connection "
                                                             "before it read what this rank lent it"))
        return error

    # ---- shutdown -----------------------------------------------------------------------------------
    def _settle(self, deadline: float) -> None:
        """Until ``deadline``, wait for every TCP connection's queued frames to be written and acknowledged
        by the peer's kernel (``SIOCOUTQ``: bytes sent and not acknowledged, or not sent yet), while the
        background thread keeps writing and reading; a Unix socket's bytes are in the peer's queue already."""
        pending = [ch for ch in self.channels.values() if ch.sock.family != socket.AF_UNIX]
        delay = 0.001
        while pending and time.monotonic() < deadline:
            pending = [ch for ch in pending if not ch.dead and (ch.out or _unacked(ch.sock))]
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        if pending:
            log.warning("rank %d: closed with what it sent to rank(s) %s not acknowledged within %.0fs", self.rank,
                        brief([ch.peer for ch in pending]), self.linger)

    def shutdown(self) -> None:
        if self._progress is not None and self.settling:
            self._settle(time.monotonic() + self.linger)
        if self._progress is not None:
            self._progress.stop()
        for ch in self.channels.values():
            try:
                ch.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            ch.sock.close()
