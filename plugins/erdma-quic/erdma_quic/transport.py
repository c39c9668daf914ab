"""The QUIC transport: one mutually authenticated QUIC connection per pair of ranks, all on one UDP socket,
every message on streams of its own (``streams``). The core's ``MessageTransport`` does the matching, ABORT,
BYE and lost peers; the connection logic is the sans-IO ``mesh``, driven by the threads that post and wait
(``driver``; a background thread between collectives); striping over worker processes is ``lanes``.

Higher ranks dial lower ranks, as in the TCP transport. A listener asks the dialler for its certificate,
checks it names a rank of this job signed by the job's CA (``tls``, ``credentials``), then waits for its
HELLO; the dialler checks the listener's certificate names the rank it meant to reach. Nothing is read from
a peer before both checks pass.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from erdma_core.sdk import (
    CollectiveTimeoutError,
    ConfigError,
    Header,
    ProtocolError,
    Request,
    TransportContext,
    UnreachableError,
)
from erdma_core.toolkit import MessageTransport, addresses, failed_elsewhere, verdicts

from . import congestion as _congestion  # noqa: F401  registers "bbr" with aioquic
from . import tls
from .driver import Driver
from .lanes import Countdown, Lanes
from .mesh import Back, Event, Joined, Lost, Mesh, Refused, Settings
from .streams import Inbound, message_parts

log = logging.getLogger("erdma.quic")
_ABORTED_WAIT = 2.0  # seconds close waits for peers to acknowledge what was sent, after an abort
TAKEN_LOOK_S = 0.1  # seconds between looks whether another transport took peers (``ctx.taken``) during set-up
RELAYED = verdicts.Verdicts()  # sites this process reached only through a relay lately


def settings(opts: dict[str, Any], rank: int, world: int, job: int, verify: bool,
             peers: frozenset[int] | None = None) -> Settings:
    return Settings(rank=rank, world=world, job=job, peers=peers, window=int(opts["send_window_bytes"]),
                    reconnect_timeout=float(opts["reconnect_timeout"]), idle_timeout=float(opts["idle_timeout"]),
                    keepalive_interval=float(opts["keepalive_interval"]), verify=verify,
                    path_recheck=float(opts["path_recheck"]))



def engine_name(opts: dict[str, Any]) -> str:
    """The engine ``transport.quic.engine`` selects: ``auto`` is the compiled one where erdma-quic was built
    with it, else aioquic (warned once per process, naming what to install)."""
    choice = str(opts["engine"])
    if choice != "auto":
        return choice
    from .ngtcp2.connection import loaded

    if loaded() is not None:
        return "ngtcp2"
    _warn_no_engine()
    return "aioquic"


@functools.cache
def _warn_no_engine() -> None:
    from .ngtcp2.connection import INSTALL

    log.warning("transport.quic.engine = auto: %s; until then erdma-quic runs on aioquic (Python, several times "
                "the CPU per byte)", INSTALL)


def connection_for(opts: dict[str, Any]) -> Callable[..., Any]:
    """What makes one mesh's connections: aioquic's, or the compiled engine's with the session-ticket keys
    of that mesh's listener (PluginError, naming what to install, where it was chosen and not built)."""
    if engine_name(opts) == "aioquic":
        from .aioquic_engine import AioquicConnection

        return AioquicConnection
    from .ngtcp2.connection import require
    from .ngtcp2.mesh_connection import EngineFactory

    require()
    return EngineFactory()  # this endpoint's ticket keys and connection-id table


def secret_hint(why: str) -> str:
    """What a failed certificate check most often means between ranks of one job."""
    words = ("certificate", "issuer", "verify", "signature")
    if any(w in why.lower() for w in words):
        return (" (the ranks hold different secrets or CA files: security.secret / transport.quic.secret / "
                "transport.quic.ca_cert must be the same on every rank)")
    return ""


class QuicTransport(MessageTransport):
    """Factory signature for the registry: ``QuicTransport(config, section)``."""

    name = "QUIC"
    devices = frozenset({"cpu"})

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        super().__init__()
        self.opts = section
        self.part_bytes = int(section["part_bytes"])
        self.engine = engine_name(section)  # aioquic or ngtcp2 (what ``auto`` resolves to here)
        self.mesh: Mesh | None = None
        self.endpoint: Driver | None = None
        self.lanes: Lanes | None = None  # striping workers (transport.quic.workers)
        self._cond = threading.Condition()
        self._joined: set[int] = set()
        self._refused: dict[int, str] = {}
        self._relays: set[tuple[str, int]] = set()  # peers' addresses on a TURN relay (that this rank dials, or
        # that a peer behind TURN over TCP dials it from)
        self._store: Any = None  # where the paths are published (a traversal with candidates: erdma doctor reads them)
        self._publishes: bool | Callable[[], None] = True  # ``ctx.publish_paths``: whether they are, or who does
        self._sites: dict[int, str] = {}  # dialled peers' sites (``verdicts.site``)
        self._punches: dict[int, list[tuple[bytes, Any]]] = {}  # per dialling peer: what opens this rank's NAT to it
        self._taken: Callable[[], frozenset[int] | None] | None = None  # ``ctx.taken``, until it answered
        self._narrowing = threading.Lock()

    # ---- set-up -------------------------------------------------------------------------------------
    def open(self, ctx: TransportContext) -> None:
        o = self.opts
        self._taken = ctx.taken
        if o["workers"] and ctx.peers is not None:
            raise ConfigError(f"config key 'transport.quic.workers': value {o['workers']} cannot take effect when QUIC "
                              "carries only the pairs another transport could not connect (transport.fallback): "
                              "valid here: 0")
        lane_sockets = None
        if o["workers"] and ctx.udp_socket is not None:
            if ctx.udp_sockets is None:
                raise ConfigError(f"transport.quic.workers = {o['workers']} needs every worker's own UDP port to be "
                                  "reachable, and the traversal handed over a single punched socket (it prepares "
                                  "no socket per lane); valid here: 0")
            lane_sockets = ctx.udp_sockets(o["workers"])  # each with its own NAT mapping
        if not o["secret"] and ctx.secret and not (o["ca_cert"] or o["ca_key"]):
            o = {**o, "secret": ctx.secret.decode()}  # the job's secret (security.secret) stands for QUIC's own
        creds = tls.load(o, self.rank, self.job)
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
        if ctx.candidates is not None:
            mine = ctx.candidates(host, port)
        else:
            mine = [addresses.Candidate(*(ctx.advertise(host, port) if ctx.advertise is not None else (host, port)))]
        self.mesh = Mesh(settings(o, self.rank, self.world_size, self.job, creds.verify, frozenset(self.peers())),
                         creds.configure,
                         creds.identify, self._inbound_for, self.mailbox.waiting_on, connection=connection_for(o))
        self.endpoint = Driver(sock, self.mesh, self._on_event, f"erdma-quic-{self.rank}", gso=o["gso"])
        ctx.store.set(f"quic/engine/{self.rank}", self.engine.encode())  # before the address a dialler reads
        ctx.store.set(f"quic/addr/{self.rank}", addresses.publish(mine))
        deadline = time.monotonic() + ctx.connect_timeout
        if o["workers"]:  # they start (import, bind) while lane 0 connects
            self.lanes = Lanes(o["workers"], self.rank, self.world_size, self.job, dict(o), self._lane_events(),
                               lane_sockets)
        punching = None
        if ctx.punch is not None and ctx.udp_socket is not None:
            punching = threading.Thread(target=self._punch, args=(ctx, sock, deadline), name=f"erdma-punch-{self.rank}",
                                        daemon=True)
            punching.start()
        for peer in (p for p in self.peers() if p < self.rank):
            cands = self._candidates_of(ctx, peer, deadline)
            if cands is None:  # another transport took it
                continue
            self._same_engine(ctx, peer)
            plan, wait = ctx.dial_plan(cands) if ctx.dial_plan is not None else (cands[:1], 0.0)
            if not plan:
                raise ConfigError(f"rank {self.rank}: none of rank {peer}'s addresses "
                                  f"({', '.join(c.text() for c in cands)}) is one this rank may dial")
            addrs = [(c.host, c.port) for c in plan]
            self._relays.update(a for a, c in zip(addrs, plan, strict=True) if c.kind == "relay")
            self._sites[peer] = where = verdicts.site(cands)
            relay = next((a for a, c in zip(addrs, plan, strict=True) if c.kind == "relay"), None)
            ago = RELAYED.failed_before(where) if relay is not None else None
            first = relay if ago is not None else None
            if first is not None:
                log.info("rank %d: rank %d at %s was reached through the relay in a set-up %.0f s ago: dialled there "
                         "first (its direct candidates are checked every path_recheck)", self.rank, peer, where, ago)
            self.endpoint.call(self.mesh.dial, peer, addrs[0], self.endpoint.now, addrs[1:], wait, first)
        self._wait_all(deadline, ctx.connect_timeout, lambda: failed_elsewhere(ctx.store, ctx.job))
        if punching is not None:  # (every peer joined: each had published, so it is about done)
            punching.join(max(0.0, deadline - time.monotonic()))
            for peer, punches in list(self._punches.items()):
                self.endpoint.call(self.mesh.punch_towards, peer, punches)
        if self.lanes is not None:
            self.lanes.connect(ctx, bind_host, listen_host, deadline)
        self.endpoint.call(self.mesh.start_keepalive, self.endpoint.now)
        if ctx.dial_plan is not None:
            self._store = ctx.store
            self._publishes = ctx.publish_paths
            self._publish_paths(changed=False)
            self._remember()

    def _punch(self, ctx: TransportContext, sock: socket.socket, deadline: float) -> None:
        """Open this rank's NAT to each rank that will dial it: the traversal's datagram to the peer's
        advertised address as soon as it is published (twice, a moment apart, against a lost one). A peer
        that never publishes is reported by the set-up's wait, not here. The datagrams for a peer's direct
        candidates are kept (``_punches``): the mesh sends them again at each ``path_recheck``, so that a pair
        that runs through a relay can find its direct path again; a peer's relay candidates are noted, as the
        address it may dial from (behind TURN over TCP)."""
        assert ctx.punch is not None
        for peer in (p for p in self.peers() if p > self.rank):
            try:
                cands = self._candidates_of(ctx, peer, deadline)
            except Exception as exc:  # the set-up's own wait names what is missing
                log.debug("rank %d: no hole punched towards rank %d: %s", self.rank, peer, exc)
                continue
            if cands is None:  # another transport took it
                continue
            self._relays.update((c.host, c.port) for c in cands if c.kind == "relay")
            kept = self._punches.setdefault(peer, [])
            for cand in cands:  # each on its own: one that fails must not keep the others (their relay permission)
                try:
                    datagram = ctx.punch(cand.host, cand.port)
                    for _ in range(2 if datagram else 0):
                        sock.sendto(datagram, (cand.host, cand.port))
                        time.sleep(0.05)
                except Exception as exc:  # a host address at another site may have no route from here: expected
                    (log.debug if cand.kind == "host" else log.warning)(
                        "rank %d: no hole punched towards rank %d at %s: %s: %s", self.rank, peer, cand.text(),
                        type(exc).__name__, exc)
                    continue
                if datagram and cand.kind != "relay":
                    kept.append((datagram, (cand.host, cand.port)))

    @staticmethod
    def _published(ctx: TransportContext, peer: int, deadline: float) -> list[addresses.Candidate]:
        return addresses.published_candidates(ctx.store, f"quic/addr/{peer}", max(0.01, deadline - time.monotonic()))

    def _candidates_of(self, ctx: TransportContext, peer: int, deadline: float) -> list[addresses.Candidate] | None:
        """``peer``'s published candidates, waited for until ``deadline``; None once another transport took the
        peer (``ctx.taken``), which is looked at meanwhile."""
        while True:
            self._narrow()
            if peer not in self.peers():
                return None
            until = deadline if self._taken is None else min(deadline, time.monotonic() + TAKEN_LOOK_S)
            try:
                return self._published(ctx, peer, until)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise

    def _same_engine(self, ctx: TransportContext, peer: int) -> None:
        """ConfigError naming both engines when ``peer`` (whose address is published, so its engine is) runs
        another: the engines frame messages differently (and announce different ALPNs, so their handshake
        would fail without saying why). The core tells every rank why this one gave up."""
        theirs = ctx.store.get(f"quic/engine/{peer}", 1.0).decode(errors="replace")
        if theirs != self.engine:
            raise ConfigError(f"config key 'transport.quic.engine': rank {self.rank} runs the {self.engine} engine "
                              f"and rank {peer} the {theirs} engine; they frame messages differently, so every rank "
                              "must run the same one (valid: aioquic, ngtcp2, or auto where every host built ngtcp2)")

    def _narrow(self) -> None:
        """Once ``ctx.taken`` names the peers another transport took (it raises if that one failed): they are
        dropped here, dials and connections (the mesh lets go of them without a word), and not waited for."""
        with self._narrowing:
            taken = self._taken() if self._taken is not None else None
            if taken is None:
                return
            self._taken = None
            mine = set(taken) & set(self.peers())
            if mine:
                assert self.endpoint is not None and self.mesh is not None
                self.endpoint.call(self.mesh.release, frozenset(mine))
                self.forget(mine)
            log.info("rank %d: QUIC lets go of ranks %s (another transport connected them) and keeps ranks %s",
                     self.rank, sorted(mine), self.peers())

    def _publish_paths(self, changed: bool = True) -> None:
        """Log how each peer is reached (a warning when one is relayed) and publish it as ``paths/RANK``
        (``PEER HOST:PORT direct|relayed`` lines) for ``erdma doctor``; or, when a paired transport publishes
        the job's paths (``ctx.publish_paths`` a callable), tell it that a path ``changed`` after set-up."""
        try:
            paths = self.paths()
            relayed = [r for r, p in paths.items() if p.endswith(" relayed")]
            loud = relayed and self._publishes is True  # (a paired transport says it for the whole job)
            (log.warning if loud else log.info)("rank %d: QUIC (%s) paths to its peers: %s", self.rank,
                                                   engine_name(self.opts), ", ".join(
                f"rank {r} at {p}" for r, p in sorted(paths.items())))
            if self._publishes is not True:  # a paired transport publishes the job's paths
                if changed and callable(self._publishes):
                    self._publishes()
                return
            addresses.publish_paths(self._store, self.rank, paths)
        except Exception as exc:  # closing, or the store is gone: the log above is what is left
            log.debug("rank %d: paths not published: %s", self.rank, exc)

    def _remember(self) -> None:
        """The dialled peers' sites this rank reached only through a relay, for this process's next set-ups
        (``verdicts``: an elastic job's next epoch dials them at the relay first)."""
        for peer, how in self.paths().items():
            if peer in self._sites:
                (RELAYED.failed if how.endswith(" relayed") else RELAYED.worked)(self._sites[peer])

    def slow_peers(self) -> set[int] | None:
        """The peers reached through a TURN relay, when the traversal offers candidates (else None: never)."""
        if self._store is None:
            return None
        return {r for r, p in self.paths().items() if p.endswith(" relayed")}

    def paths(self) -> dict[int, str]:
        """Per peer: the address its connection runs to now, and ``direct``, or ``relayed`` (dialled at the
        peer's relay candidate, or reaching this rank through its own: the socket says so)."""
        if self.mesh is None or self.endpoint is None:
            return {}
        mesh, sock = self.mesh, self.endpoint.sock
        peers = self.endpoint.run_sync(mesh.paths)
        relayed = getattr(sock, "relayed", lambda addr: False)

        def how(addr: Any) -> str:  # (the address as the connection keeps it: the socket may have tagged it)
            return "relayed" if tuple(addr[:2]) in self._relays or relayed(addr) else "direct"

        return {r: f"{a[0]}:{a[1]} {how(a)}" for r, a in peers.items()}

    def _inbound_for(self, peer: int) -> Inbound:
        return Inbound(peer, self.inbox(peer), lambda hello: None)

    def _lane_events(self) -> dict[str, Any]:
        """What the striping lanes report, as the two things they need: parts that landed, and failures."""
        def land(peer: int, head: bytes, payload: memoryview, lane: int) -> None:
            assert self.endpoint is not None and self.mesh is not None
            self.endpoint.call(self.mesh.land, peer, head, payload, lane)

        def lost(peer: int, why: str) -> None:
            assert self.endpoint is not None and self.mesh is not None
            self.endpoint.call(self.mesh.lose, peer, why)

        def fatal(error: BaseException) -> None:
            if not self.closing:
                self.abort(error, wait=False)

        return {"land": land, "lost": lost, "fatal": fatal}

    def _on_event(self, ev: Event) -> None:
        """On the thread driving the mesh, under its lock: what the mesh reports."""
        if isinstance(ev, Joined):
            with self._cond:
                self._joined.add(ev.peer)
                self._cond.notify_all()
        elif isinstance(ev, Refused):
            with self._cond:
                self._refused[ev.peer] = f"rank {ev.peer} at {ev.addr[0]}:{ev.addr[1]}: {ev.why}"
                self._cond.notify_all()
        elif isinstance(ev, Lost) and ev.peer in self.peers():  # (not one another transport took)
            assert self.mesh is not None
            self.mesh.fail(ev.peer, self.peer_lost(ev.peer, ev.why))
        elif isinstance(ev, Back) and self._store is not None:  # perhaps on another path: said off this thread
            threading.Thread(target=self._publish_paths, name=f"erdma-paths-{self.rank}", daemon=True).start()

    def _wait_all(self, deadline: float, timeout: float, gave_up: Callable[[], str | None]) -> None:
        """Until every peer joined (and, with ``ctx.taken``, those another transport took are known and let go
        of); ``gave_up()`` says why another rank stopped its set-up (or None)."""
        with self._cond:
            while True:
                want, final = set(self.peers()), self._taken is None
                refused = [why for peer, why in self._refused.items() if peer in want] if final else []
                if refused:
                    raise ProtocolError(f"rank {self.rank}: QUIC connection to {refused[0]}{secret_hint(refused[0])}")
                missing = sorted(want - self._joined)
                if not missing and final:
                    return
                left = deadline - time.monotonic()
                if left <= 0 and not missing:
                    raise CollectiveTimeoutError(f"rank {self.rank}: QUIC set-up: the transport checked beside it "
                                                 f"did not say which pairs it took within {timeout:.1f}s",
                                                 rank=self.rank, op="connect")
                if left <= 0:
                    self._cond.release()  # the mesh's lock is taken without this one (events are reported under it)
                    try:
                        refused = self._refusals()
                    finally:
                        self._cond.acquire()
                    more = f" (refused: {refused}{secret_hint(refused)})" if refused else ""
                    raise UnreachableError(f"rank {self.rank}: ranks {missing} did not connect over QUIC within "
                                           f"{timeout:.1f}s{more}", peers=tuple(missing), rank=self.rank, op="connect")
                self._cond.wait(min(left, 0.5 if final else TAKEN_LOOK_S))
                self._cond.release()  # the store is asked without the lock the mesh's events are reported under
                try:
                    why = gave_up()
                    self._narrow()
                finally:
                    self._cond.acquire()
                if why is not None:
                    raise ConfigError(f"rank {self.rank}: set-up stopped: {why}")

    def _refusals(self) -> str:
        """The listener's latest refusals, read under the mesh's lock."""
        if self.mesh is None or self.endpoint is None:
            return ""
        mesh = self.mesh
        return self.endpoint.run_sync(lambda: "; ".join(list(mesh.refusals)[-3:]))  # type: ignore[no-any-return]

    # ---- data path ----------------------------------------------------------------------------------
    def post(self, peer: int, header: Header, payload: memoryview, deadline: float, req: Request,
             urgent: bool = False) -> None:
        assert self.endpoint is not None and self.mesh is not None
        parts = message_parts(header, payload, self.part_bytes)
        if self.lanes is not None and len(parts) > 1:
            n = len(self.lanes.workers) + 1
            mine = parts[::n]
            countdown = Countdown(1 + len(parts) - len(mine), req)
            for i, (head, body) in enumerate(parts):
                if i % n:
                    self.lanes.send(i % n, peer, head, body, countdown)
            parts, req = mine, countdown
        try:  # built and sent on this thread, under the mesh's lock, which is never held for long
            self.endpoint.run_sync(self.mesh.send, peer, parts, req, urgent, timeout=max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            req.complete(CollectiveTimeoutError(f"rank {self.rank}: QUIC could not take a message to rank {peer} "
                                                "before the collective's deadline", rank=self.rank, op="send"))

    def wait(self, req: Request, deadline: float) -> bool:
        if self.endpoint is None:
            return req.wait(deadline)
        return self.endpoint.wait(req, deadline)

    def link_rate(self, peer: int) -> float | None:
        """Bytes per second the congestion controller measured towards ``peer`` (lane 0's connection)."""
        return self.mesh.link_rate(peer) if self.mesh is not None else None

    # ---- what tests and the lab read ------------------------------------------------------------------
    def link_stats(self) -> dict[int, dict[str, int]]:
        """Per peer: the mesh's counters (``Mesh.link_stats``) and ``gso``: 1 where runs to it go as UDP GSO
        messages now (its path answered a probe whole)."""
        endpoint, mesh = self.endpoint, self.mesh
        assert endpoint is not None and mesh is not None

        def collect() -> dict[int, dict[str, int]]:
            stats, proven = mesh.link_stats(), set(endpoint.gso_paths.proven()) if endpoint.gso else set()
            for r, addr in mesh.paths().items():
                stats[r]["gso"] = int(addr in proven)
            return stats

        return endpoint.run_sync(collect)  # type: ignore[no-any-return]

    def pending_accepts(self) -> int:
        assert self.endpoint is not None and self.mesh is not None
        return self.endpoint.run_sync(self.mesh.pending_accepts)  # type: ignore[no-any-return]

    def lane_stats(self) -> dict[str, list[int]]:
        """Parts sent and received per lane (lane 0: this process), when striping."""
        if self.lanes is None:
            return {}
        return {"parts_out": list(self.lanes.parts_out), "parts_in": list(self.lanes.parts_in)}

    # ---- shutdown -------------------------------------------------------------------------------------
    def _not_waited_for(self) -> frozenset[int]:
        """Peers whose acknowledgements a close does not wait for (``Mailbox.unwaited``): a lost one, those an
        abort by the caller said are gone, and those whose own ABORT came (they are closing too: what they did
        not acknowledge yet, they may never)."""
        return frozenset(self.mailbox.unwaited) if self.mailbox is not None else frozenset()

    def shutdown(self) -> None:
        endpoint, mesh = self.endpoint, self.mesh
        if endpoint is None or mesh is None:
            if self.lanes is not None:
                self.lanes.stop()
            return
        linger = self.linger if self.settling else _ABORTED_WAIT  # what was sent is acknowledged before closing
        end = time.monotonic() + linger
        while time.monotonic() < end:
            try:
                if endpoint.run_sync(mesh.flushed, self._not_waited_for(), timeout=1.0):
                    break
            except Exception:  # the loop is gone
                break
            time.sleep(0.01)
        else:
            log.warning("rank %d: closed with parts it sent not acknowledged within %.0fs", self.rank, linger)
        if self.lanes is not None:
            self.lanes.close(max(1.0, end - time.monotonic()))
        try:
            endpoint.run_sync(mesh.close, endpoint.now, timeout=2.0)
        except Exception:  # the loop is already gone
            pass
        time.sleep(0.05)  # let CONNECTION_CLOSE leave
        endpoint.stop()
