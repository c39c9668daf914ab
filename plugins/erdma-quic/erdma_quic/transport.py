"""The QUIC transport: one mutually authenticated QUIC connection per pair of ranks, all on one UDP socket,
every message on streams of its own (``streams``), driven by an asyncio loop in a thread (``endpoint``).

Higher ranks dial lower ranks, as in the TCP transport. A listener asks the dialler for its certificate,
checks it names a rank of this job signed by the job's CA (``credentials``), then waits for its HELLO;
the dialler checks the listener's certificate names the rank it meant to reach. Nothing is read from a peer
before both checks pass. The listener gives the dialler a single-use session ticket; a connection that ends
by idle timeout is dialled again with it (TLS resumption, 0-RTT) and picks up where it stopped (``link``).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from aioquic.quic.configuration import QuicConfiguration
from aioquic.tls import CipherSuite, SessionTicket

from erdma_core.errors import CollectiveTimeoutError, ConfigError, PeerLostError, ProtocolError
from erdma_core.transport import addresses
from erdma_core.transport.base import TransportContext
from erdma_core.transport.mailbox import Mailbox, Request
from erdma_core.transport.wire import ABORT, BYE, HELLO_REQUEST, Header, Hello, abort_body

from . import congestion as _congestion  # noqa: F401  registers "bbr" with aioquic
from . import credentials as cred
from .endpoint import Endpoint, datagram_size
from .lanes import Countdown, Lanes
from .link import Link, Outgoing
from .session import Connection, PeerSession
from .streams import PartSink, hello_stream, message_parts

log = logging.getLogger("erdma.quic")
ALPN = "erdma/1"
CIPHERS = {
    "aes128gcm": CipherSuite.AES_128_GCM_SHA256,
    "aes256gcm": CipherSuite.AES_256_GCM_SHA384,
    "chacha20": CipherSuite.CHACHA20_POLY1305_SHA256,
}
_MAX_PENDING_ACCEPTS = 64


class QuicTransport:
    """Factory signature for the registry: ``QuicTransport(config, section)``."""

    devices = frozenset({"cpu"})

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        self.opts = section
        self.rank = -1
        self.world_size = 0
        self.job = 0
        self.mailbox: Mailbox | None = None
        self.links: dict[int, Link] = {}  # peers that joined
        self.tickets: dict[bytes, tuple[SessionTicket, int]] = {}  # issued to diallers: label -> (ticket, rank)
        self.reconnect_timeout = float(section["reconnect_timeout"])
        self.closing = False
        self.window = int(section["send_window_bytes"])
        self.part_bytes = int(section["part_bytes"])
        self.verify = True
        self.ca_pem = b""
        self._creds: cred.RankCredentials | None = None
        self._cond = threading.Condition()
        self._failures: dict[str, str] = {}
        self._pending: list[PeerSession] = []
        self.endpoint: Endpoint = None  # type: ignore[assignment]
        self.sink: PartSink | None = None  # a striping lane's: where whole parts go instead of the mailbox
        self.lanes: Lanes | None = None  # striping workers (transport.quic.workers)

    # ---- credentials ---------------------------------------------------------------------------------
    def _credentials(self) -> None:
        o = self.opts
        if o["insecure_dev_mode"]:
            msg = (f"rank {self.rank}: transport.quic.insecure_dev_mode is on: peers are NOT authenticated; anyone "
                   "who can reach this port can join the job or read its data. Development only.")
            warnings.warn(msg, stacklevel=2)
            log.warning("%s", msg)
            self.verify = False
            ca = cred.new_authority("eRDMA insecure dev CA")
        elif o["secret"]:
            ca = cred.derived_authority(o["secret"].encode(), self.job)
        else:
            cert_path, key_path = self._ca_files()
            try:
                ca = cred.read_authority(cert_path, key_path)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"transport.quic: cannot use the CA {cert_path} / {key_path}: {exc}") from None
        self.ca_pem = ca.pem
        self._creds = cred.issue(ca, self.rank, self.job)

    def _ca_files(self) -> tuple[Path, Path]:
        o = self.opts
        if o["ca_cert"] or o["ca_key"]:
            if not (o["ca_cert"] and o["ca_key"]):
                raise ConfigError("transport.quic.ca_cert and transport.quic.ca_key go together; "
                                  f"got ca_cert={o['ca_cert']!r}, ca_key={o['ca_key']!r}")
            return Path(o["ca_cert"]), Path(o["ca_key"])
        d = cred.default_dir()
        if (d / "ca.pem").exists() and (d / "ca.key").exists():
            return d / "ca.pem", d / "ca.key"
        raise ConfigError(
            "transport 'quic' needs credentials and found none: run `erdma keys init` (writes "
            f"{d}/ca.pem and ca.key; share them with every host of the cluster), or set "
            "transport.quic.ca_cert and transport.quic.ca_key, or transport.quic.secret (a shared secret; "
            "credentials are derived per job). transport.quic.insecure_dev_mode = true turns authentication "
            "off (development only)")

    def _configuration(self, client: bool, addr: Any, peer: int | None,
                       ticket: SessionTicket | None = None) -> QuicConfiguration:
        o = self.opts
        assert self._creds is not None
        cipher = CIPHERS[o["cipher"]]
        c = QuicConfiguration(
            is_client=client, alpn_protocols=[ALPN], idle_timeout=o["idle_timeout"],
            max_datagram_size=datagram_size(addr, o["datagram_size"]),
            max_data=max(4 * self.window, 16 << 20), max_stream_data=max(2 * self.part_bytes, 1 << 20),
            congestion_control_algorithm=o["congestion_control"],
            cipher_suites=[cipher, *[c for c in CIPHERS.values() if c != cipher]],
            verify_mode=ssl.CERT_REQUIRED if self.verify else ssl.CERT_NONE,
            server_name=cred.identity(peer, self.job) if peer is not None else None,
            session_ticket=ticket,
        )
        c.certificate = self._creds.cert
        c.private_key = self._creds.key
        c.cadata = self.ca_pem
        return c

    # ---- set-up -------------------------------------------------------------------------------------
    def connect(self, ctx: TransportContext) -> None:
        self.rank, self.world_size, self.job = ctx.rank, ctx.world_size, ctx.job
        self.mailbox = Mailbox(ctx.rank, ctx.job)
        self._credentials()
        o = self.opts
        if o["workers"] and ctx.udp_socket is not None:
            raise ConfigError(f"transport.quic.workers = {o['workers']} needs every worker's own UDP port to be "
                              "reachable, and the traversal handed over a single punched socket; valid here: 0")
        bind_host, advertised = addresses.choose(o["bind_address"], o["interface"], getattr(ctx.store, "host", None))
        if ctx.udp_socket is not None:  # handed over by the traversal (a punched hole): keep using its mapping
            sock = ctx.udp_socket
            bound = sock.getsockname()[0]
            host, port = (advertised if bound in ("0.0.0.0", "") else bound), sock.getsockname()[1]
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((bind_host, o["port"]))
            host, port = advertised, sock.getsockname()[1]
        listen_host = host
        if ctx.advertise is not None:
            host, port = ctx.advertise(host, port)
        self.endpoint = Endpoint(sock, self._accept, f"erdma-quic-{self.rank}", gso=o["gso"])
        ctx.store.set(f"quic/addr/{self.rank}", f"{host}:{port}".encode())
        deadline = time.monotonic() + ctx.connect_timeout
        try:
            if o["workers"]:  # they start (import, bind) while lane 0 connects
                self.lanes = Lanes(self, o["workers"])
            for peer in range(self.rank):
                addr = addresses.published(ctx.store, f"quic/addr/{peer}", max(0.01, deadline - time.monotonic()))
                self.endpoint.run_sync(self._dial, peer, addr)
            self._wait_all(deadline, ctx.connect_timeout)
            if self.lanes is not None:
                self.lanes.connect(ctx, bind_host, listen_host, deadline)
        except BaseException:
            self.close()
            raise
        self.endpoint.call(self._keepalive)

    def _dial(self, peer: int, addr: tuple[str, int], link: Link | None = None) -> PeerSession:
        """Dial ``peer``; the HELLO leaves with the first flight that can carry it (0-RTT when resuming)."""
        if link is None:
            link = Link(self, peer, addr, dialler=True)
        session = PeerSession(self, peer, addr)
        session.conn = Connection(configuration=self._configuration(True, addr, peer, link.ticket),
                                  session_ticket_handler=session.issued_ticket)
        session.conn.connect(addr, now=self.endpoint.now)
        link.attach(session)
        session.send_raw(hello_stream(Hello(HELLO_REQUEST, self.job, self.rank, self.world_size)))
        self.endpoint.add(session)
        self.endpoint.touch(session)
        return session

    def redial(self, link: Link) -> None:
        """On the loop thread: the connection to a live peer ended; dial it again, resuming with its ticket."""
        session = self._dial(link.rank, link.addr, link)
        if self.verify:  # the listener knows who this is before it reads a byte: send the backlog now
            link.go(session)

    def _accept(self, dcid: bytes, addr: Any) -> PeerSession | None:
        if self.closing or len(self._pending) >= _MAX_PENDING_ACCEPTS or not self.diallers():
            return None
        session = PeerSession(self, None, addr)
        session.conn = Connection(configuration=self._configuration(False, addr, None),
                                  original_destination_connection_id=dcid,
                                  session_ticket_fetcher=session.fetch_ticket,
                                  session_ticket_handler=session.issued_ticket)
        self._pending.append(session)
        return session

    def diallers(self) -> set[int]:
        """Ranks that dial this one (and may dial it again)."""
        return set(range(self.rank + 1, self.world_size))

    def keep_ticket(self, ticket: SessionTicket, rank: int) -> None:
        """Listener: ``ticket`` went to ``rank``; it replaces the one that rank held."""
        self.tickets = {k: v for k, v in self.tickets.items() if v[1] != rank}
        self.tickets[ticket.ticket] = (ticket, rank)

    def joined(self, link: Link) -> None:
        with self._cond:
            self.settled(link.session)
            self.links[link.rank] = link
            self._cond.notify_all()

    def settled(self, session: PeerSession | None) -> None:
        """An accepted connection is no longer pending: it joined, or took over a link that had."""
        if session in self._pending:
            self._pending.remove(session)

    def pending_accepts(self) -> int:
        """Accepted connections not yet identified and settled (at most 64 at a time are taken)."""
        return self.endpoint.run_sync(lambda: len(self._pending))

    def link_stats(self) -> dict[int, dict[str, int]]:
        """Per peer: reconnections, resumed TLS sessions, accepted 0-RTT first flights, parts sent again."""
        return self.endpoint.run_sync(lambda: {r: dict(link.stats) for r, link in self.links.items()})

    def lane_stats(self) -> dict[str, list[int]]:
        """Parts sent and received per lane (lane 0: this process), when striping."""
        if self.lanes is None:
            return {}
        return {"parts_out": list(self.lanes.parts_out), "parts_in": list(self.lanes.parts_in)}

    def setup_failed(self, session: PeerSession) -> None:
        with self._cond:
            if session in self._pending:
                self._pending.remove(session)
            if session.dialled:
                self._failures[f"rank {session.rank} at {session.addr[0]}:{session.addr[1]}"] = session.failure or "?"
            self._cond.notify_all()

    def _wait_all(self, deadline: float, timeout: float) -> None:
        want = set(range(self.world_size)) - {self.rank}
        with self._cond:
            while True:
                refused = {k: v for k, v in self._failures.items() if int(k.split()[1]) < self.rank}
                if refused:
                    who, why = next(iter(refused.items()))
                    raise ProtocolError(f"rank {self.rank}: QUIC connection to {who} failed: {why}")
                missing = sorted(want - self.links.keys())
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError(f"rank {self.rank}: ranks {missing} did not connect over QUIC within "
                                                 f"{timeout:.1f}s", rank=self.rank, op="connect")
                self._cond.wait(min(left, 0.5))

    def _keepalive(self) -> None:
        if self.closing:
            return
        for link in list(self.links.values()):
            s = link.session
            if s is not None and not s.terminated:
                s.conn.send_ping(0)
                self.endpoint.touch(s)
        self.endpoint.loop.call_later(self.opts["keepalive_interval"], self._keepalive)

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
        link = self.links[peer]
        parts = message_parts(header, data, self.part_bytes)
        if self.lanes is not None and len(parts) > 1:
            n = len(self.lanes.workers) + 1
            mine = parts[::n]
            req = Countdown(1 + len(parts) - len(mine))
            for i, (head, body) in enumerate(parts):
                if i % n:
                    self.lanes.send(i % n, peer, head, body, req)
            parts = mine
        self.endpoint.call(self._enqueue_data, link, Outgoing(parts, req))
        return req

    def _enqueue_data(self, link: Link, item: Outgoing) -> None:
        link.sent_frames += 1
        link.enqueue(item)

    # ---- failure and shutdown -------------------------------------------------------------------------
    def lost(self, link: Link, why: str) -> None:
        """On the loop thread: a peer that joined is gone or misbehaved."""
        if link.dead:
            return
        err = PeerLostError(f"rank {self.rank}: lost rank {link.rank} over QUIC: {why}", peer=link.rank,
                            rank=self.rank)
        link.fail(err)
        if self.closing or self.mailbox is None:
            return
        if self.mailbox.aborted is None:
            log.warning("%s", err)
        self._abort_on_loop(err)

    def abort(self, error: BaseException) -> None:
        """Fail everything pending here and tell every reachable peer why (best effort, bounded)."""
        assert self.mailbox is not None
        if self.mailbox.aborted is not None or self.closing:
            self.mailbox.abort(error)
            return
        done = threading.Event()
        self.endpoint.call(self._abort_on_loop, error, done)
        done.wait(2.0)

    def fatal(self, error: BaseException) -> None:
        """On the loop thread: this rank cannot go on (a striping worker died); fail and tell the peers."""
        self._abort_on_loop(error)

    def _abort_on_loop(self, error: BaseException, done: threading.Event | None = None) -> None:
        assert self.mailbox is not None
        first = self.mailbox.aborted is None
        self.mailbox.abort(error)
        if self.lanes is not None:
            self.lanes.fail(error)
        reqs = []
        if first:
            body = abort_body(error)
            frame = Header(ABORT, 0, 0, 0, self.job, 0, 0, 0, 0, len(body))
            for link in self.links.values():
                if link.rank == getattr(error, "peer", None) or link.dead:
                    continue
                r = Request()
                link.enqueue(Outgoing(message_parts(frame, body, self.part_bytes), r), first=True)
                reqs.append(r)
        if done is not None:
            self._when_flushed(reqs, done)

    def _when_flushed(self, reqs: list[Request], done: threading.Event, tries: int = 100) -> None:
        if (all(r.done() for r in reqs) and all(link.session is None or not link.session.open_streams
                                                 or link.session.terminated for link in self.links.values())) \
                or tries <= 0:
            done.set()
            return
        self.endpoint.loop.call_later(0.01, self._when_flushed, reqs, done, tries - 1)

    def close(self) -> None:
        if self.closing or self.endpoint is None:
            self.closing = True
            return
        self.closing = True
        done = threading.Event()
        self.endpoint.call(self._say_bye, done)
        done.wait(3.0)
        if self.lanes is not None:
            self.lanes.close()
        try:
            self.endpoint.run_sync(self._close_all, timeout=2.0)
        except Exception:  # the loop is already gone
            pass
        time.sleep(0.05)  # let CONNECTION_CLOSE leave
        self.endpoint.stop()

    def _say_bye(self, done: threading.Event) -> None:
        reqs = []
        for link in self.links.values():
            if link.dead or link.session is None:
                continue
            r = Request()
            frame = Header(BYE, 0, 0, 0, self.job, 0, link.sent_frames, 0, 0, 0)
            link.enqueue(Outgoing(message_parts(frame, b"", self.part_bytes), r))
            reqs.append(r)
        self._when_flushed(reqs, done, tries=250)

    def _close_all(self) -> None:
        sessions = [link.session for link in self.links.values() if link.session is not None]
        for s in sessions:
            rec = s.conn._loss
            log.debug("rank %d -> rank %d at close: %s, srtt %.5f s, datagrams dropped by a full socket %d",
                      self.rank, s.rank, rec._cc.get_log_data(), rec._rtt_smoothed, self.endpoint.send_drops)
        for s in [*sessions, *self._pending]:
            s.conn.close()
            self.endpoint.touch(s)

