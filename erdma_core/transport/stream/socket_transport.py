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
import functools
import logging
import math
import select
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ...errors import (
    AuthenticationError,
    CollectiveTimeoutError,
    ConfigError,
    ErdmaError,
    IntegrityError,
    PeerLostError,
    ProtocolError,
    UnreachableError,
)
from ...net import addresses, meet
from ...net.addresses import Candidate
from ...net.sockets import probe_idle, recv_exact
from ...security import auth, integrity
from ...wire import BYE, DATA, LENT, PULL, PULLED, RAW, Header, control
from .. import verdicts
from ..base import MessageTransport, TransportContext, failed_elsewhere
from ..frames import FrameInbox, Pool, StreamReader
from ..mailbox import Lent
from ..request import Request
from ..verdicts import TCP_MEETINGS
from . import single_copy
from .accept import Acceptor
from .progress import Channel, Progress

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
class _Accepted(Exception):
    """A meeting ended because the acceptor took the peer's connection."""


BACKLOG = 1024  # connections the kernel queues for the acceptor (a flood of them must not push a rank's out)
STRIPE_BYTES = 1 << 16  # a data frame at least this large goes to the pool's least loaded connection
LANE_DIALS = 8  # connections of one pool made at once
POLL = 1.0  # seconds a socket call may block before deadlines and shutdown are looked at again
SETUP_POLL = 0.5  # seconds between looks at the store, during set-up, for a rank that gave up
DIAL_SLICE_S = 3.0  # a dial's tries between two looks (a lost SYN is sent again after 1 s: one resend fits)


class SocketTransport(MessageTransport):
    """Subclasses implement ``listen(ctx) -> [(listening socket, address peers dial), ...]`` (one or more;
    peers try the addresses in order) and ``dial(address, deadline) -> connected socket`` (retrying until
    ``deadline``; ``sockets.retrying`` helps), or None when that address cannot be reached from here (another
    host's Unix socket), and may override ``tune(sock)`` and set ``spin``. ``key`` names the store entries
    that publish the addresses (no spaces in them). To go through NATs, a subclass offers ``meeting_point``
    (and ``nearby`` for the addresses it still dials): every other peer is then met, not dialled.

    ``connections`` > 1 makes a pool: a pair of ranks that dials over TCP opens that many connections, and
    each data frame of at least ``STRIPE_BYTES`` goes to the one with the fewest bytes waiting (queued here or
    unacknowledged in the kernel), so one flow's window does not cap a long, fat link; the chunks of a
    collective's messages (``collectives.chunk_bytes``) spread over them. Frames are matched by key, never by
    order, so they may overtake each other; each connection ends with a BYE of its own. A Unix socket, and a
    pair that meets through NATs (one mapped port each), keep one connection."""

    streams = True  # set-up hands it the traversal's TCP socket (``ctx.tcp_socket``), not a UDP one

    key = "stream"
    spin = 0.0  # seconds a thread waiting for a message polls before it sleeps (see ``Progress.wait``)
    tls = False  # TLS over each TCP connection once it is authenticated (``transport.tcp.tls``)
    lend_bytes = 0  # messages of at least this many bytes are lent to a peer that can read them (0: never)
    connections = 1  # connections per pair of ranks that dials over TCP (a pool, ``transport.tcp.connections``)

    def __init__(self) -> None:
        super().__init__()
        self.channels: dict[int, Channel] = {}  # each peer's first connection (control frames go there)
        self.lanes: dict[int, list[Channel]] = {}  # each peer's connections, the first one first
        self._turns: dict[int, int] = {}  # the pool's connection whose turn it is on a tie, per peer
        self._progress: Progress | None = None
        self._key = b""  # the job's transport key (``auth.job_key``)
        self._lend_to: frozenset[int] = frozenset()  # peers that read this rank's memory (``single_copy``)
        self._pids: dict[int, int] = {}  # peers whose memory this rank reads, and their processes
        self.meeting: tuple[socket.socket, list[Candidate]] | None = None  # ``meeting_point``'s answer, in set-up
        self._gave_up = False  # set-up ended (failed or not): meetings under way stop
        self._arrivals = meet.Arrivals()  # lower ranks' meetings the listener took
        self._paths: dict[int, str] = {}  # when meeting: peer -> ``HOST:PORT direct`` (its address in use)

    def listen(self, ctx: TransportContext) -> list[tuple[socket.socket, str]]:
        raise NotImplementedError

    def dial(self, address: str, deadline: float) -> socket.socket | None:
        raise NotImplementedError

    def tune(self, sock: socket.socket) -> None:
        """Set socket options on every connection (nothing by default)."""

    def meeting_point(self, ctx: TransportContext) -> tuple[socket.socket, list[Candidate]] | None:
        """Where this rank meets the peers it does not dial or accept (``meet``: both ends connect at once,
        through NATs): the traversal's bound socket (``ctx.tcp_socket``; listened on during set-up, its port
        reused by each meeting) and the candidates published for it; None (the default): this transport
        listens and dials only. During set-up ``self.meeting`` holds the answer (``listen`` may look)."""
        return None

    def nearby(self, address: str) -> bool:
        """Whether one of a peer's published ``address``-es is dialled even when this rank meets the others
        (on this host, say); False by default."""
        return False

    # ---- set-up -------------------------------------------------------------------------------------
    def open(self, ctx: TransportContext) -> None:
        self.meeting = self.meeting_point(ctx)
        if ctx.settle is not None and self.meeting is None:
            raise ConfigError("config key 'transport.fallback': a second transport for the pairs the built-in TCP "
                              "cannot connect needs a traversal that meets peers through NATs (traversal.name = "
                              "\"stun\"): without one, every pair dials and either connects or fails; valid here: none")
        listening = self.listen(ctx)
        for _, address in listening:
            auth.warn_if_exposed(address.rsplit(":", 1)[0], ctx.secret, f"rank {self.rank}'s {self.name} transport")
        if self.meeting is not None:
            ctx.store.set(f"{self.key}/meet/{self.rank}", addresses.publish(self.meeting[1]))
        ctx.store.set(f"{self.key}/addr/{self.rank}", " ".join(address for _, address in listening).encode())
        deadline = time.monotonic() + ctx.connect_timeout
        self._key = auth.job_key(ctx.secret, ctx.job)
        listeners = [s for s, _ in listening]
        met: dict[int, tuple[socket.socket, bytes, str]] = {}
        if self.meeting is not None:
            self._arrivals = meet.Arrivals(self.world_size - 1)
            self.meeting[0].listen(BACKLOG)  # where no NAT filters, a peer's SYN arrives here
            listeners.append(self.meeting[0])
            self._learn_lower(ctx, deadline)  # before accepting: which connections come from a lower rank
        accepting = Acceptor(listeners, deadline, key=self._key, job=self.job, rank=self.rank,
                             world=self.world_size, tune=self.tune,
                             divert=self._arrivals.divert if self.meeting is not None else None,
                             lanes=self.connections if self.meeting is None else 1)
        acceptor = threading.Thread(target=accepting.run, name=f"erdma-accept-{self.rank}", daemon=True)
        acceptor.start()
        try:
            if self.meeting is None:
                for peer in range(self.rank):
                    addrs = self._address_of(ctx, peer, deadline)
                    self._dial_pool(ctx, peer, addrs.split(), deadline)
                while acceptor.is_alive() and time.monotonic() < deadline:
                    acceptor.join(SETUP_POLL)
                    self._check_others(ctx)
            else:
                self._meet_all(ctx, accepting, met, deadline)
        finally:
            self._gave_up = True
            accepting.stop = True
            acceptor.join(2 * POLL)
            for listener in listeners:
                listener.close()
            self._arrivals.close()
        if ctx.settle is not None:
            self._keep(ctx.settle(set(met) | {p for p in accepting.accepted if accepting.complete(p)}), met, accepting)
        for peer, (sock, transcript, path) in sorted(met.items()):
            self._add(peer, sock, transcript, peer < self.rank, deadline)
            self._paths[peer] = path
        for peer, lanes in sorted(accepting.accepted.items()):
            for lane, sock in sorted(lanes.items()):
                if self.meeting is not None and sock.family == socket.AF_INET:
                    self._paths[peer] = f"{_name(sock.getpeername())} direct"  # its SYN reached this listener
                self._add(peer, sock, accepting.transcripts[(peer, lane)], False, deadline)
        for channels in self.lanes.values():
            if len(channels) > 1:
                Pool([ch.reader.inbox for ch in channels])
        self.stripes = max((len(channels) for channels in self.lanes.values()), default=1)
        if self.stripes > 1:
            log.info("rank %d: %d %s connections to each of ranks %s", self.rank, self.stripes, self.name,
                     brief(sorted(p for p, channels in self.lanes.items() if len(channels) > 1)))
        if self.meeting is not None and ctx.publish_paths:
            self._publish_paths(ctx)
        if accepting.duplicates:
            raise AuthenticationError(f"rank {self.rank}: two processes proved to be rank(s) "
                                      f"{sorted(accepting.duplicates)} of this job (duplicate rank); "
                                      "each rank must be started once")
        missing = [p for p in self.peers() if p > self.rank and not accepting.complete(p) and p not in met]
        if missing:
            refused = "; ".join(list(accepting.refused)[-3:])
            raise UnreachableError(f"rank {self.rank}: ranks {brief(missing)} did not connect within "
                                   f"{ctx.connect_timeout:.1f}s" + (f" (refused: {refused})" if refused else ""),
                                   peers=tuple(missing), rank=self.rank, op="connect")
        if self.lend_bytes:
            self._probe_single_copy(deadline)
        self._progress = Progress([ch for lanes in self.lanes.values() for ch in lanes], self._channel_ended,
                                  self._corrupt, f"erdma-io-{self.rank}", self.spin)

    def _keep(self, kept: set[int], met: dict[int, tuple[socket.socket, bytes, str]], accepting: Acceptor) -> None:
        """Only the connections to ``kept`` peers are used (``ctx.settle``): the others are closed, and those
        peers are another transport's."""
        for peer in [p for p in met if p not in kept]:
            meet.drop(met.pop(peer)[0])
        for peer in [p for p in accepting.accepted if p not in kept]:
            for sock in accepting.accepted.pop(peer).values():
                meet.drop(sock)
        self.forget(set(self.peers()) - kept)

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

    def _learn_lower(self, ctx: TransportContext, deadline: float) -> None:
        """Where each lower rank meets (its published candidates), so that a connection from one of those
        addresses is known as that rank's meeting (``meet.Arrivals``)."""
        for peer in range(self.rank):
            self._address_of(ctx, peer, deadline)  # published after its candidates (and looks for give-ups)
            try:
                self._arrivals.expect(peer, addresses.published_candidates(ctx.store, f"{self.key}/meet/{peer}", 0.5))
            except Exception:  # it does not meet (listens and dials only): nothing arrives from it here
                pass

    def _know(self, ctx: TransportContext, peer: int, addrs: list[str]) -> None:
        """Every host ``peer`` is published at (its meeting candidates and its addresses), so that the listener
        can tell a lower rank's connection from a NAT that picked a new port for it (``meet.Arrivals``)."""
        try:
            cands = addresses.published_candidates(ctx.store, f"{self.key}/meet/{peer}", 0.5)
        except Exception:  # it does not meet (listens and dials only)
            cands = []
        for a in addrs:
            try:
                cands += addresses.candidates(a)
            except (ValueError, OSError):  # not HOST:PORT (a Unix socket's path)
                pass
        self._arrivals.known(peer, cands)

    def _meet_all(self, ctx: TransportContext, accepting: Acceptor, met: dict[int, tuple[socket.socket, bytes, str]],
                  deadline: float) -> None:
        """Every peer reached at once, each on a thread of its own (two ranks' handshakes never wait on a
        third's): a nearby one as without a meeting point, the rest met (``_meet``); into ``met``, or, for
        a higher rank whose own connection this rank's acceptor took, there."""
        failed: dict[int, BaseException] = {}
        optional = ctx.settle is not None  # a pair not met within one check is another transport's
        unmet: dict[int, str] = {}

        def reach(peer: int) -> None:
            try:
                addrs = self._address_of(ctx, peer, deadline).split()
                self._know(ctx, peer, addrs)
                if any(self.nearby(a) for a in addrs):
                    if peer < self.rank:
                        sock, transcript = self._dial_peer(ctx, peer, lambda: self._connect(ctx, peer, addrs,
                                                                                            deadline), deadline)
                        met[peer] = sock, transcript, f"{addrs[0]} direct"
                    return
                got = self._meet(ctx, peer, deadline, lambda: accepting.complete(peer), optional)
                if got is not None:
                    met[peer] = got
            except CollectiveTimeoutError as exc:  # no path over this transport (in time)
                if optional:
                    unmet[peer] = str(exc)
                else:
                    failed[peer] = exc
            except BaseException as exc:
                failed[peer] = exc

        def missing() -> list[int]:
            return [p for p in others if p not in met and p not in unmet and not accepting.complete(p)]

        others = [p for p in range(self.world_size) if p != self.rank]
        threads = [threading.Thread(target=reach, args=(p,), name=f"erdma-meet-{self.rank}-{p}", daemon=True)
                   for p in others]
        for t in threads:
            t.start()
        while time.monotonic() < deadline and not failed and missing():
            threads[0].join(SETUP_POLL / 5)
            self._check_others(ctx)
        for t in threads:  # at the deadline, each meeting says why it failed
            t.join(max(0.0, min(SETUP_POLL, deadline + SETUP_POLL - time.monotonic())) if missing() else 0)
        refused = {p: e for p, e in failed.items() if not isinstance(e, CollectiveTimeoutError)}
        if refused:  # a peer refused, or is not of this job
            raise refused[min(refused)]
        unreached = missing()  # (those that failed in time among them)
        if unreached:
            first = failed[min(failed)] if failed else None
            raise UnreachableError(f"rank {self.rank}: ranks {brief(unreached)} were not met within "
                                   f"{ctx.connect_timeout:.1f}s" + (f" ({first})" if first else ""),
                                   peers=tuple(unreached), rank=self.rank, op="connect")
        if unmet:
            log.info("rank %d: not met over %s, left to the fallback transport: %s", self.rank, self.name,
                     "; ".join(f"rank {p}: {why}" for p, why in sorted(unmet.items())))

    def _meet(self, ctx: TransportContext, peer: int, deadline: float, accepted: Callable[[], bool],
              optional: bool = False) -> tuple[socket.socket, bytes, str] | None:
        """A connection to ``peer`` made from both ends at once (``meet``) and proved by the job's handshake,
        this rank the dialler if it is the higher one; its transcript; and the candidate of the peer's it
        reached. A connection whose handshake fails is dropped and the ranks meet again, until ``deadline``.
        None when the acceptor took the peer's connection instead (``accepted()``: a higher rank's SYN
        reached this rank's listener)."""
        assert self.meeting is not None
        local = self.meeting[0].getsockname()[:2]
        theirs = addresses.published_candidates(ctx.store, f"{self.key}/meet/{peer}",
                                                max(0.01, deadline - time.monotonic()))
        plan, wait = ctx.dial_plan(theirs) if ctx.dial_plan is not None else (theirs[:1], 0.0)
        plan = [c for c in plan if c.kind != "relay"]  # a TURN relay carries datagrams, not this stream
        meet_by = deadline
        if optional and wait > 0:  # one check of each candidate; a connection made by then has one more for its
            meet_by = min(deadline, time.monotonic() + wait * len(plan))  # handshake; then another transport
            deadline = min(deadline, meet_by + wait)  # takes the pair
        within = ctx.connect_timeout if not optional else max(0.0, meet_by - time.monotonic())
        if not plan and optional:
            raise CollectiveTimeoutError(f"rank {self.rank}: rank {peer} offers only a relay", rank=self.rank,
                                         op="connect")
        where = verdicts.site(theirs)
        ago = TCP_MEETINGS.failed_before(where) if optional else None
        if ago is not None:  # a set-up of this process lost this check lately: not again (an elastic job's epochs)
            raise CollectiveTimeoutError(f"rank {self.rank}: rank {peer} at {where}: not met over {self.name} in a "
                                         f"set-up {ago:.0f} s ago (checked again {verdicts.REMEMBER_S:.0f} s after)",
                                         rank=self.rank, op="connect")
        if not plan:
            raise ConfigError(f"rank {self.rank}: none of rank {peer}'s addresses "
                              f"({', '.join(c.text() for c in theirs)}) can be met over {self.name}: a peer that only a "
                              "relay reaches needs a datagram transport (transport.name = \"quic\")")
        used: list[Candidate] = []

        def connect() -> tuple[socket.socket, str]:
            got = meet.meet(local, plan, wait, meet_by, lambda: self._gave_up or accepted(),
                            lambda: self._arrivals.take(peer))
            if got is None:
                if accepted():
                    raise _Accepted
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: rank {peer} was not met at {', '.join(c.text() for c in plan)} within "
                    f"{within:.1f}s (both connect at once from their published ports; a NAT that maps "
                    "each destination to a new port, or a firewall, keeps them apart: use transport.name = \"quic\" "
                    "with a relay, or transport.fallback = \"quic\" with one for the pairs TCP cannot meet)",
                    rank=self.rank, op="connect")
            used.append(got[1])
            return got[0], got[1].text()

        try:
            if peer < self.rank:
                sock, transcript = self._dial_peer(ctx, peer, connect, deadline)
            else:
                sock, transcript = self._accept_met(peer, connect, deadline)
        except _Accepted:
            TCP_MEETINGS.worked(where)
            return None
        except CollectiveTimeoutError:
            if optional:
                TCP_MEETINGS.failed(where)
            raise
        TCP_MEETINGS.worked(where)
        return sock, transcript, f"{used[-1].host}:{used[-1].port} direct"

    def _accept_met(self, peer: int, connect: Callable[[], tuple[socket.socket, str]],
                    deadline: float) -> tuple[socket.socket, bytes]:
        """The accepting side of the handshake, with ``peer`` only, on connections ``connect()`` makes; one
        that fails is dropped and made again until ``deadline`` (then the last reason is raised)."""
        while True:
            sock, addr = connect()
            hs = auth.Accepting(self._key, self.job, self.rank, self.world_size, range(peer, peer + 1),
                                lambda rank, lane, lanes: None if lanes == 1 else auth.WRONG_LANES)
            try:  # the higher rank speaks first; silence (its listener took this for another): connect again
                sock.settimeout(max(0.1, min(deadline - time.monotonic(), meet.HELLO_S)))
                probe_idle(sock)
                while hs.need:
                    sock.sendall(hs.feed(recv_exact(sock, hs.need)))
            except (OSError, ConnectionError, ProtocolError) as exc:
                meet.drop(sock)
                if time.monotonic() >= deadline:
                    raise CollectiveTimeoutError(f"rank {self.rank}: rank {peer} at {addr} did not complete the "
                                                 f"HELLO handshake: {exc}", rank=self.rank, op="connect") from None
                continue
            if hs.rank_proven != peer:
                meet.drop(sock)
                raise AuthenticationError(f"rank {self.rank}: the connection met at {addr} for rank {peer} was "
                                          f"refused: {hs.refused}")
            probe_idle(sock, False)
            self.tune(sock)
            sock.settimeout(POLL)
            return sock, hs.transcript

    def paths(self) -> dict[int, str]:
        """How each peer is reached when this rank meets them (``meeting_point``): ``HOST:PORT direct``, the
        peer's address the connection goes to (a stream has no relayed paths); empty when it listens and dials."""
        return dict(self._paths)

    def _publish_paths(self, ctx: TransportContext) -> None:
        """Log how each peer is reached and publish it as ``paths/RANK`` (``PEER HOST:PORT direct`` lines, as
        erdma-quic does) for ``erdma doctor``."""
        log.info("rank %d: %s paths to its peers: %s", self.rank, self.name,
                 ", ".join(f"rank {r} at {p}" for r, p in sorted(self._paths.items())))
        addresses.publish_paths(ctx.store, self.rank, self._paths)

    def _pool_size(self, sock: socket.socket) -> int:
        """Connections a pair has when this rank dials over ``sock``: ``connections`` over TCP, one over a Unix
        socket or when this rank meets its peers."""
        return 1 if sock.family == socket.AF_UNIX or self.meeting is not None else self.connections

    def _dial_pool(self, ctx: TransportContext, peer: int, addrs: list[str], deadline: float) -> None:
        """Every connection to lower rank ``peer``, taken into use: the first to the first of its ``addrs``
        reachable from here, then, over TCP, the rest of the pool (``connections``) to that address, several
        at once (on a long path each handshake takes round trips)."""
        try:
            made = [self._dial_peer(ctx, peer, functools.partial(self._connect, ctx, peer, addrs, deadline), deadline)]
        except CollectiveTimeoutError:
            self._check_others(ctx)  # refused by a rank that gave up already: why the set-up stopped, if one said
            raise
        lanes = self._pool_size(made[0][0])
        if lanes > 1:
            connect = functools.partial(self._connect, ctx, peer, [_name(made[0][0].getpeername())], deadline)
            with ThreadPoolExecutor(min(LANE_DIALS, lanes - 1), thread_name_prefix=f"erdma-dial-{self.rank}") as dial:
                made += dial.map(lambda lane: self._dial_peer(ctx, peer, connect, deadline, lane, lanes),
                                 range(1, lanes))
        for sock, transcript in made:  # TLS, if on, only now: the peer starts its side once all are in
            self._add(peer, sock, transcript, True, deadline)

    def _dial_peer(self, ctx: TransportContext, peer: int, connect: Callable[[], tuple[socket.socket, str]],
                   deadline: float, lane: int = 0, lanes: int | None = None) -> tuple[socket.socket, bytes]:
        """A connection to ``peer`` that passed the handshake (this rank the dialler), and the handshake's
        transcript; ``connect()`` makes the connection. It is connection ``lane`` of the pair's ``lanes``
        (None: of ``connections`` over TCP, the only one over a Unix socket or when this rank meets its
        peers). A connection the peer closed before the handshake ended (its acceptor was full, or dropped
        it) is made again, with back-off, until ``deadline``; a refusal is final. An attempt is never given
        up before ``deadline``: the peer may have taken it."""
        delay = 0.02
        while True:
            sock, addr = connect()
            pool = lanes or self._pool_size(sock)
            hs = auth.Dialling(self._key, self.job, self.rank, peer, self.world_size, lane=lane, lanes=pool)
            try:
                sock.settimeout(max(0.1, deadline - time.monotonic()))  # never shorter: the peer may have taken it
                probe_idle(sock)  # a drop whose FIN or reset was lost is noticed in seconds
                sock.sendall(hs.first())
                self._await_answer(ctx, sock, deadline)
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
                self._check_others(ctx)
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
                continue
            except (ProtocolError, AuthenticationError):
                sock.close()
                raise
            if hs.error is not None:
                sock.close()
                raise hs.error
            probe_idle(sock, False)
            self.tune(sock)
            sock.settimeout(POLL)
            return sock, hs.transcript

    def _await_answer(self, ctx: TransportContext, sock: socket.socket, deadline: float) -> None:
        """Until ``sock`` has bytes to read or ``deadline``, looking every ``SETUP_POLL`` seconds whether a
        rank gave up (a peer whose kernel took the connection may be stopped: its answer never comes)."""
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        while time.monotonic() < deadline:
            if poller.poll(max(0, min(SETUP_POLL, deadline - time.monotonic())) * 1000):
                return  # bytes, or the connection's end: recv_exact reads either
            self._check_others(ctx)

    def _connect(self, ctx: TransportContext, peer: int, addrs: list[str], deadline: float
                 ) -> tuple[socket.socket, str]:
        """A connected socket to the first of ``peer``'s addresses reachable from here, and that address.
        ``dial`` is given ``DIAL_SLICE_S`` at a time, and between its tries this looks whether the set-up
        stopped: a peer that went is refused until ``deadline`` (an elastic newcomer's check dialled a member
        that had finished for 60 s)."""
        for addr in addrs:
            while True:
                try:
                    sock = self.dial(addr, min(deadline, time.monotonic() + DIAL_SLICE_S))
                    break
                except OSError as exc:
                    if time.monotonic() >= deadline:
                        raise CollectiveTimeoutError(f"rank {self.rank}: cannot connect to rank {peer} at {addr}: "
                                                     f"{exc}", rank=self.rank, op="connect") from None
                    self._check_others(ctx)
            if sock is not None:
                return sock, addr
        raise CollectiveTimeoutError(f"rank {self.rank}: none of rank {peer}'s addresses ({' '.join(addrs)}) "
                                     "can be reached from here", rank=self.rank, op="connect")

    def _add(self, peer: int, sock: socket.socket, transcript: bytes, dialled: bool, deadline: float) -> None:
        """Take an authenticated connection to ``peer`` into use (the next of its pool, the first one first):
        TLS over it when ``self.tls``, else every frame on it sealed, unless it is a Unix socket (TLS and
        seals protect bytes on a path; those never leave the kernel)."""
        check = seal = None
        if sock.family != socket.AF_UNIX:
            link = f"{self.name} {_name(sock.getpeername())} -> {_name(sock.getsockname())}"
            if self.tls:
                from . import tls

                sock = tls.secure(sock, server=not dialled, key=self._key, transcript=transcript,  # type: ignore[assignment]
                                  timeout=max(0.1, deadline - time.monotonic()), rank=self.rank, peer=peer)
            else:
                send, receive = integrity.keys(self._key, transcript, dialled)
                seal = integrity.Sealer(send)
                check = integrity.Checker(receive, rank=self.rank, peer=peer, where=link)
        lanes = self.lanes.setdefault(peer, [])
        inbox = self.inbox(peer) if not lanes else FrameInbox(self.rank, peer, self.mailbox)
        ch = Channel(peer, sock, StreamReader(inbox, check))
        ch.seal = seal
        lanes.append(ch)
        self.channels.setdefault(peer, ch)

    # ---- sending and waiting ----------------------------------------------------------------------------
    def link_rate(self, peer: int) -> float | None:
        """Bytes per second the connections to ``peer`` deliver: the sum of the kernel's measured delivery
        rates of TCP (``TCP_INFO``), unbounded for a Unix socket (memory on one host); None before any has
        measured."""
        lanes = self.lanes.get(peer, [])
        if not lanes or any(ch.dead for ch in lanes):
            return None
        if lanes[0].sock.family == socket.AF_UNIX:
            return math.inf
        total = 0
        for ch in lanes:
            try:
                info = ch.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
            except OSError:
                return None
            total += struct.unpack_from("<Q", info, _DELIVERY_RATE)[0] if len(info) >= _TCP_INFO_BYTES else 0
        return float(total) or None

    def _lane(self, peer: int, nbytes: int) -> Channel | None:
        """The connection a data frame of ``nbytes`` to ``peer`` goes on: the first, or of a pool the one
        with the fewest frames queued here, then the fewest bytes the peer has not acknowledged, ties taken
        in turn."""
        lanes = self.lanes.get(peer)
        if not lanes:
            return None
        if len(lanes) == 1 or nbytes < STRIPE_BYTES:
            return lanes[0]
        turn = self._turns[peer] = (self._turns.get(peer, -1) + 1) % len(lanes)
        return min(lanes[turn:] + lanes[:turn], key=lambda ch: (ch.dead, len(ch.out), _unacked(ch.sock)))

    def post(self, peer: int, header: Header, payload: memoryview, deadline: float, req: Request,
             urgent: bool = False) -> None:
        ch = self._lane(peer, payload.nbytes if header.kind == DATA else 0)
        if ch is None or self._progress is None:
            req.complete(ErdmaError(f"rank {self.rank}: no connection to rank {peer}"))
            return
        if header.kind == BYE:  # each connection says how many data frames went on it
            for other in self.lanes[peer][1:]:
                self._send(other, header._replace(seq=other.frames), payload, None, urgent)
            header = header._replace(seq=ch.frames)
        if (peer in self._lend_to and payload.nbytes >= self.lend_bytes and header.kind == DATA
                and header.codec == RAW and payload.c_contiguous):
            self._lend(ch, header, payload, req)
            return
        self._send(ch, header, payload, req, urgent)

    def _send(self, ch: Channel, header: Header, payload: memoryview, req: Request | None, urgent: bool) -> None:
        """One frame on ``ch``, sealed when its frames are."""
        assert self._progress is not None
        if header.kind == DATA:
            with self._count_lock:
                ch.frames += 1
        if ch.seal is None:
            self._progress.send(ch, (header.pack(), payload), req, urgent)
            return
        head, tail = ch.seal.seal(header.pack(), payload)
        self._progress.send(ch, head if tail is None else (head, payload, tail), req, urgent)  # type: ignore[arg-type]

    def _lend(self, ch: Channel, header: Header, payload: memoryview, req: Request) -> None:
        """Send where ``payload`` lies instead of its bytes; ``req`` completes when the peer has read it."""
        ticket = self.mailbox.lend(ch.peer, req, payload)
        if ticket is None:
            return
        with self._count_lock:
            ch.frames += 1  # a PULL lands as a data frame
        body = LENT.pack(single_copy.address_of(payload), payload.nbytes, ticket)
        assert self._progress is not None
        self._progress.send(ch, (header._replace(kind=PULL, nbytes=LENT.size).pack(), body), None)
        if ch.dead:  # it closed before or while the frame was handed over: nobody will read it (the error
            # its end was met with, as _channel_ended gave it to what was lent before)
            self.mailbox.fail_lent(ch.peer, self.mailbox.aborted or PeerLostError(
                f"rank {self.rank}: lost rank {ch.peer} over {self.name}: its connection closed before it read what "
                "this rank lent it", peer=ch.peer, rank=self.rank))

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
        # a peer that closed after its ABORT: what was still to be sent to it fails with what it said
        return error or (self.mailbox.aborted if cleanly else None)

    # ---- shutdown -----------------------------------------------------------------------------------
    def _settle(self, deadline: float) -> None:
        """Until ``deadline``, wait for every TCP connection's queued frames to be written and acknowledged
        by the peer's kernel (``SIOCOUTQ``: bytes sent and not acknowledged, or not sent yet), while the
        background thread keeps writing and reading; a Unix socket's bytes are in the peer's queue already."""
        pending = [ch for lanes in self.lanes.values() for ch in lanes if ch.sock.family != socket.AF_UNIX]
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
        for ch in (ch for lanes in self.lanes.values() for ch in lanes):
            try:
                ch.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            ch.sock.close()

