"""The ``dpdk`` transport: the core's ``MessageTransport`` over the C shim's reliable streams (``shim.c``), one
per peer, on DPDK ports: memif (one port per pair of ranks, shared-memory rings between the two processes),
or af_packet (one port on this rank's network interface, shared by every peer).

Set-up, through the job's store (``dpdk/JOB/RANK``): each rank starts the EAL (``eal``), makes its pool and
ports (memif: it serves the socket of every pair whose other rank is higher, in a folder per job, with a memif
secret derived from the job's secret; it dials the sockets lower ranks publish), publishes its endpoint nonce,
frame size, window and port MAC, adds a link per peer, waits for the ports' links and for every peer to be
ready. Packets from a peer are taken only with the job's id and the nonce that peer published (an earlier
life of a rank, another job on the wire: dropped).

Data: ``post`` hands the frame (the core's header, then the payload, by address) to the shim, which cuts the
first packets at once on the calling thread and the rest as acknowledgements open the window; a send is
complete when its last byte is in a packet. Arriving bytes are read out of the shim's reorder window through
the core's ``StreamReader`` (a large payload whose receive is posted lands straight in its memory). A thread
that waits drives the shim itself (no hand-over between threads for small messages); an I/O thread does it
when nobody waits (acknowledgements, retransmissions, keepalives)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import pathlib
import secrets
import socket
import threading
import time
from typing import Any

from erdma_core.sdk import ConfigError, Header, IntegrityError, PeerLostError, Request, TransportContext
from erdma_core.toolkit import DIRECT_BYTES, MessageTransport, StreamReader, auth, await_key, failed_elsewhere, integrity

from . import backends, eal
from ._shim import ffi, lib

log = logging.getLogger("erdma.dpdk")
_MBUF_OVERHEAD = 128 + 128 + 64  # headroom, struct rte_mbuf, mempool header per element
_names = itertools.count()
_ids = itertools.count(1)


def _fanout_group(iface: str) -> str:
    """The fanout group DPDK 22.11's af_packet joins on ``iface`` from this process."""
    try:
        return str((os.getpid() ^ socket.if_nametoindex(iface)) & 0xFFFF)
    except OSError:
        return "unknown (no such interface)"


class _Link:
    __slots__ = ("dead", "error", "peer", "reader", "sink")

    def __init__(self, peer: int, reader: StreamReader) -> None:
        self.peer, self.reader = peer, reader
        self.dead = False
        self.error: BaseException | None = None
        self.sink: Any = None  # the buffer the shim writes arriving bytes into (kept alive while it does)


MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, the last a NUL


def run_dir(option: str) -> pathlib.Path:
    if option:
        return pathlib.Path(option)
    if os.geteuid() == 0:
        return pathlib.Path("/run/erdma-dpdk")
    if os.environ.get("XDG_RUNTIME_DIR"):
        return pathlib.Path(os.environ["XDG_RUNTIME_DIR"]) / "erdma-dpdk"
    return pathlib.Path(f"/tmp/erdma-dpdk-{os.getuid()}")


class DpdkTransport(MessageTransport):
    """Factory signature for the registry: ``DpdkTransport(config, section)``."""

    name = "DPDK"
    devices = frozenset({"cpu"})

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        super().__init__()
        self.opts = section
        self.backend = section["backend"]
        self.ep: Any = None
        self.links: dict[int, _Link] = {}
        self._sends: dict[int, tuple[Request, int, memoryview, Any]] = {}
        self._plock = threading.Lock()  # one thread drives the shim and reads what it received: ``_driver``
        self._driver: int | None = None
        self._no_sinks = False  # aborting: the receives' memory is the callers' again
        self._waiting = 0  # threads in wait() now (under _waiting_lock)
        self._waiting_lock = threading.Lock()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
        self._tokens = ffi.new("unsigned long long[256]")
        self._status = ffi.new("int[256]")
        self._info = ffi.new("eds_link_info *")
        self._sockets: list[pathlib.Path] = []
        self._seals: dict[int, integrity.Sealer] = {}  # af_packet: every frame sealed (``integrity``)
        self._job_dir: pathlib.Path | None = None
        self._forget = lambda: None
        self.stats: dict[int, dict[str, int]] = {}

    # ---- set-up -------------------------------------------------------------------------------------------
    def open(self, ctx: TransportContext) -> None:
        deadline = time.monotonic() + ctx.connect_timeout
        o = self.opts
        iface = None
        if self.backend != "memif":
            iface = backends.interface_of(o, self.rank)
            backends.check_interface(iface)
        frame = backends.frame_of(o, iface)
        world, window, desc = ctx.world_size, o["window"], o["descriptors"]
        nports = world - 1 if self.backend == "memif" else 1
        buffer = backends.buffer_of(self.backend, frame)
        mbufs = (world - 1) * 2 * window + nports * (2 * desc + 128) + 2048
        need = max(256, int(mbufs * (buffer + _MBUF_OVERHEAD) * 1.25 / 2**20) + 64)
        eal.start(o["eal_memory_mb"] or need)
        if need > eal.memory_mb():
            log.warning("rank %d: DPDK has %d MB, this process group's pools want about %d (raise "
                        "transport.dpdk.eal_memory_mb)", self.rank, eal.memory_mb(), need)
        self.nonce = secrets.randbits(32) | 1
        tag = f"e{os.getpid() % 100000}x{next(_names)}"
        self.ep = lib.eds_ep_new(tag.encode(), self.rank, self.job & 0xFFFFFFFF, self.nonce, frame, buffer,
                                 window, desc,
                                 world, nports, o["rto_min_us"], o["rto_max_us"], int(o["keepalive"] * 1000),
                                 int(o["peer_timeout"] * 1000), o["spin_us"], o["poll_max_us"])
        if self.ep == ffi.NULL:
            self.ep = None
            raise eal.DpdkError(f"rank {self.rank}: {eal.error()}")
        self._forget = eal.on_exit(self.shutdown)
        if o["inject_loss"]:
            lib.eds_set_loss(self.ep, int(o["inject_loss"] * 1e6))
        me: dict[str, Any] = {"nonce": self.nonce, "backend": self.backend, "frame": frame, "window": window,
                              "seal": secrets.token_hex(16)}
        port_of: dict[int, int] = {}
        if self.backend == "memif":
            memif_secret = auth.job_key(ctx.secret, ctx.job).hex()[:24]
            me["servers"] = self._memif_servers(o, tag, frame, memif_secret, port_of)
        else:
            assert iface is not None
            try:
                self._add_port(f"net_af_packet_{tag}", backends.af_packet_args(iface, frame, desc), watch=False)
            except eal.DpdkError as exc:
                raise eal.DpdkError(f"{exc} (DPDK's af_packet joins the socket to fanout group (pid XOR ifindex) "
                                    f"& 0xffff, here {_fanout_group(iface)}: a "
                                    "process in this network namespace that holds that group on another interface "
                                    "makes it fail; starting this rank again gives it another pid)") from None
            me["mac"] = self._mac(0)
        ctx.store.set(self._key(ctx.job, self.rank), json.dumps(me).encode())
        for peer in self.peers():
            theirs = json.loads(self._get(ctx, self._key(ctx.job, peer), deadline))
            for key, name in (("backend", "backend"), ("frame", "frame_bytes"), ("window", "window")):
                if theirs[key] != me[key]:
                    raise ConfigError(f"config key 'transport.dpdk.{name}': rank {peer} has {theirs[key]}, rank "
                                      f"{self.rank} has {me[key]}; every rank needs the same")
            if self.backend == "memif":
                if peer < self.rank:
                    args = backends.memif_args(server=False, socket=theirs["servers"][str(self.rank)], frame=frame,
                                               o=o, secret=memif_secret,
                                               zero_copy=o["memif_zero_copy"] and eal.lend_memory())
                    port_of[peer] = self._add_port(f"net_memif_{tag}_{peer}", args, watch=True)
                mac = bytes(6)
            else:
                port_of[peer] = 0
                mac = bytes.fromhex(theirs["mac"])
            if lib.eds_add_link(self.ep, peer, port_of[peer], mac, theirs["nonce"]) != 0:
                raise eal.DpdkError(f"rank {self.rank}: {eal.error()}")
            self.links[peer] = _Link(peer, StreamReader(self.inbox(peer), self._sealing(ctx, peer, me, theirs, iface)))
        while not lib.eds_links_up(self.ep):
            if time.monotonic() > deadline:
                raise eal.DpdkError(f"rank {self.rank}: the {self.backend} links did not come up within "
                                    f"{ctx.connect_timeout:.0f}s")
            why = failed_elsewhere(ctx.store, ctx.job)
            if why is not None:
                raise eal.DpdkError(f"rank {self.rank}: another rank gave up: {why}")
            time.sleep(0.01)
        ctx.store.set(self._key(ctx.job, self.rank) + "/ready", b"1")
        for peer in self.links:
            self._get(ctx, self._key(ctx.job, peer) + "/ready", deadline)
        log.info("rank %d: DPDK %s, %d-byte frames, window %d, %d peers", self.rank, self.backend, frame, window,
                 len(self.links))
        self._thread = threading.Thread(target=self._run, name=f"erdma-dpdk-{self.rank}", daemon=True)
        self._thread.start()
        self._thread_id = self._thread.ident

    def _sealing(self, ctx: TransportContext, peer: int, me: dict[str, Any], theirs: dict[str, Any],
                 iface: str | None) -> integrity.Checker | None:
        """af_packet frames cross a network: each is sealed, with keys from the job's secret and both ranks'
        fresh nonces (``integrity``); memif's stay in memory two processes of the host share."""
        if self.backend == "memif":
            return None
        low, high = (me, theirs) if self.rank < peer else (theirs, me)
        transcript = f"dpdk|{min(self.rank, peer)}|{max(self.rank, peer)}|{low['seal']}|{high['seal']}".encode()
        send, receive = integrity.keys(auth.job_key(ctx.secret, ctx.job), transcript, self.rank > peer)
        self._seals[peer] = integrity.Sealer(send)
        return integrity.Checker(receive, rank=self.rank, peer=peer, where=f"DPDK af_packet on {iface}")

    def _memif_servers(self, o: dict[str, Any], tag: str, frame: int, secret: str,
                       port_of: dict[int, int]) -> dict[str, str]:
        """A listening memif port for every higher peer; returns peer -> socket path."""
        root = run_dir(o["run_dir"])
        if eal.sweep_sockets(root):
            log.info("rank %d: removed memif sockets of ranks that no longer exist under %s", self.rank, root)
        self._job_dir = root / f"{self.job & 0xFFFFFFFFFFFFFFFF:016x}"
        self._job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        servers = {}
        for peer in self.peers():
            if peer <= self.rank:
                continue
            path = self._job_dir / f"memif-{self.rank}-{peer}.{os.getpid()}.sock"
            if (length := len(os.fsencode(path))) > MAX_SOCKET_PATH:  # DPDK said "No such file or directory"
                raise eal.DpdkError(f"rank {self.rank}: the memif socket path {path} is {length} "
                                    f"bytes, over the {MAX_SOCKET_PATH} a Unix socket's address holds: set "
                                    f"transport.dpdk.run_dir (now {str(root)!r}) to a shorter folder")
            path.unlink(missing_ok=True)
            self._sockets.append(path)
            args = backends.memif_args(server=True, socket=str(path), frame=frame, o=o, secret=secret)
            port_of[peer] = self._add_port(f"net_memif_{tag}_{peer}", args, watch=True)
            servers[str(peer)] = str(path)
        return servers

    def _add_port(self, vdev: str, args: str, watch: bool) -> int:
        port = lib.eds_add_port(self.ep, vdev.encode(), args.encode(), int(watch))
        if port < 0:
            raise eal.DpdkError(f"rank {self.rank}: {eal.error()}")
        return int(port)

    def _mac(self, port: int) -> str:
        mac = ffi.new("unsigned char[6]")
        lib.eds_port_mac(self.ep, port, mac)
        return bytes(ffi.buffer(mac)).hex()

    @staticmethod
    def _key(job: int, rank: int) -> str:
        return f"dpdk/{job & 0xFFFFFFFFFFFFFFFF:016x}/{rank}"

    def _get(self, ctx: TransportContext, key: str, deadline: float) -> bytes:
        return await_key(ctx, key, deadline,
                         lambda why: eal.DpdkError(f"rank {self.rank}: {why} (is that rank running with transport dpdk?)"))

    # ---- sending ------------------------------------------------------------------------------------------
    def post(self, peer: int, header: Header, payload: memoryview, deadline: float, req: Request,
             urgent: bool = False) -> None:
        link = self.links[peer]
        if link.dead or self.ep is None:
            req.complete(link.error or self.peer_lost(peer, "its link is closed"))
            return
        data = payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
        buf = ffi.from_buffer(data) if data.nbytes else ffi.NULL
        head, tail = header.pack(), b""
        seal = self._seals.get(peer)
        if seal is not None:
            head, tail = seal.whole(head, data)
        token = next(_ids)
        self._sends[token] = (req, peer, data, buf)
        if lib.eds_send(self.ep, peer, head, len(head), buf, data.nbytes, tail, len(tail), token, int(urgent)):
            self._sends.pop(token, None)
            req.complete(link.error or self.peer_lost(peer, eal.error()))

    def fail_sends(self, error: BaseException) -> None:
        """The rank aborts: sends not started are dropped (they fail on the next dispatch)."""
        if self.ep is not None:
            lib.eds_drop_queued(self.ep)

    # ---- progress -----------------------------------------------------------------------------------------
    def _progress(self, block_us: int) -> bool | None:
        """Drive the shim up to ``block_us`` (it returns at once when something happened) and act on what it
        reports: True when it reported something, None when another thread is driving it."""
        if not self._plock.acquire(blocking=False):
            return None
        self._driver = threading.get_ident()
        try:
            if self.ep is None:
                return False
            got = bool(lib.eds_progress(self.ep, block_us))
            self._dispatch()
            return got
        finally:
            self._driver = None
            self._plock.release()

    def _dispatch(self) -> None:
        """Read what arrived and note links that failed (first: a send the shim dropped because its link
        failed then fails with that link's error), then complete the sends the shim finished or dropped."""
        ep, info = self.ep, self._info
        for peer, link in self.links.items():
            lib.eds_link_info_get(ep, peer, info)
            if info.readable or link.sink is not None:
                self._read(link)
            if info.dead and not link.dead:
                self._read(link)
                self._link_failed(link, ffi.string(info.why).decode(errors="replace"))
        while True:
            n = lib.eds_completions(ep, self._tokens, self._status, 256)
            for i in range(n):
                entry = self._sends.pop(self._tokens[i], None)
                if entry is None:
                    continue
                req, peer = entry[0], entry[1]
                if self._status[i] == 0:
                    req.complete()
                else:
                    req.complete(self.links[peer].error or self.mailbox.aborted or PeerLostError(
                        f"rank {self.rank}: send to rank {peer} dropped: the link failed", peer=peer, rank=self.rank))
            if n < 256:
                break

    def _read(self, link: _Link) -> None:
        """Hand what arrived to the frame reader: first what the shim wrote into the last place it was given,
        then what it holds; the rest of a large payload's place is left to the shim (a sink), which writes
        arriving bytes there until it is full."""
        reader, peer = link.reader, link.peer
        try:
            if link.sink is not None:
                link.sink = None
                filled = lib.eds_sink_take(self.ep, peer)
                if filled:
                    reader.advance(filled)
            while True:
                buf = reader.buffer()
                size = buf.nbytes
                where = ffi.from_buffer(buf, require_writable=True)
                # the shim keeps what is left as a sink only when the reader still takes it straight after the
                # bytes read now (DIRECT_BYTES left): then what lands there is reported with one ``advance``
                sink = reader.direct and not self._no_sinks and not link.dead
                n = lib.eds_read(self.ep, peer, where, size, DIRECT_BYTES if sink else 0)
                if n:
                    reader.advance(n)
                if n < size:
                    if sink and size - n >= DIRECT_BYTES:
                        link.sink = where
                    return
        except IntegrityError as exc:  # damaged on the way: every rank fails with it (the reader drops the rest)
            self.abort(exc, wait=False)
        except Exception as exc:  # a malformed frame: this peer's stream cannot be trusted any more
            self._link_failed(link, exc)

    def _drop_sink(self, link: _Link) -> None:
        if link.sink is not None and self.ep is not None:
            lib.eds_sink_take(self.ep, link.peer)
        link.sink = None

    def abort(self, error: BaseException, wait: bool = True) -> None:
        """The receives fail: first the shim stops writing into their memory (the callers may free it)."""
        self._no_sinks = True
        if self._driver == threading.get_ident():  # from this thread's own dispatch
            for link in self.links.values():
                self._drop_sink(link)
        else:
            with self._plock:  # the driving thread is out of the shim within its block time
                for link in self.links.values():
                    self._drop_sink(link)
        super().abort(error, wait)

    def _link_failed(self, link: _Link, why: object) -> None:
        link.dead = True
        self._drop_sink(link)
        if self.inbox(link.peer).closed_cleanly or self.closing:
            link.error = PeerLostError(f"rank {self.rank}: rank {link.peer} closed its process group",
                                       peer=link.peer, rank=self.rank)
        else:
            link.error = self.peer_lost(link.peer, why)
        # the shim failed this peer's sends that were not wholly cut; the next dispatch completes them

    def wait(self, req: Request, deadline: float) -> bool:
        """The waiting thread drives the shim itself (polling, then sleeping with back-off, inside the shim)."""
        with self._waiting_lock:
            self._waiting += 1
        try:
            while not req.finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if self._stop:
                    req.settled(left)
                    continue
                if self._progress(int(min(left, 0.02) * 1e6)) is None and not req.finished:
                    if self._driver is not None and self._driver != self._thread_id:
                        req.settled(min(left, 0.002))  # another waiter drives the shim: it completes ``req``
                    elif self.ep is not None:
                        lib.eds_wake(self.ep)  # the I/O thread: it leaves the shim to this thread at once
                        req.settled(min(left, 2e-5))
        finally:
            with self._waiting_lock:
                self._waiting -= 1
        if req.error is not None:
            raise req.error
        return True

    def _run(self) -> None:
        """The I/O thread: what nobody waits for (acknowledgements, retransmissions, keepalives, messages that
        arrive before their receive)."""
        while not self._stop:
            try:
                if self._waiting:
                    time.sleep(0.002)  # a waiting thread drives the shim: stay out of its way
                elif self._progress(20_000) is None:
                    time.sleep(0.001)
            except Exception as exc:  # a bug here must not leave the ranks hanging
                log.exception("rank %d: DPDK I/O thread failed", self.rank)
                if self.mailbox is not None:
                    self.abort(eal.DpdkError(f"rank {self.rank}: DPDK I/O thread failed: {exc!r}"), wait=False)
                return

    def counters(self) -> dict[int, dict[str, int]]:
        """Per peer: packets sent (acknowledgements and retransmissions included) and received, data packets
        made, retransmissions, duplicates dropped, and packets dropped as foreign (another job, a stale
        endpoint; for the whole endpoint); after close, the last ones."""
        if self.ep is None:
            return dict(self.stats)
        out = {}
        info = ffi.new("eds_link_info *")
        for peer in self.links:
            lib.eds_link_info_get(self.ep, peer, info)
            out[peer] = {"sent_packets": info.sent_packets, "received_packets": info.received_packets,
                         "data_packets": info.data_packets, "retransmits": info.retransmits,
                         "duplicates": info.duplicates, "foreign": info.foreign}
        return out

    # ---- closing ------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """After the BYEs: wait until every peer has acknowledged what we sent (or said goodbye, or is gone), up
        to ``linger`` (2 s after an abort), then close the ports and free the pool."""
        self._stop = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        with self._plock:
            if self.ep is None:
                self._remove_sockets()
                return
            self._driver = threading.get_ident()
            until = time.monotonic() + (self.linger if self.settling else 2.0)
            info = self._info
            while time.monotonic() < until:
                lib.eds_progress(self.ep, 1000)
                self._dispatch()
                busy = False
                for peer in self.links:
                    lib.eds_link_info_get(self.ep, peer, info)
                    busy |= bool(info.pending and not info.dead and not self.inbox(peer).closed_cleanly)
                if not busy:
                    break
            self.stats = self.counters()
            lib.eds_ep_free(self.ep)
            self.ep = None
            self._driver = None
        self._forget()
        self._remove_sockets()
        for req, peer, *_ in self._sends.values():
            req.complete(self.mailbox.aborted if self.mailbox is not None and self.mailbox.aborted else
                         PeerLostError(f"rank {self.rank}: the transport closed before this send to rank {peer} "
                                       "went", peer=peer, rank=self.rank))
        self._sends.clear()

    def _remove_sockets(self) -> None:
        for path in self._sockets:
            path.unlink(missing_ok=True)
        if self._job_dir is not None:
            try:
                self._job_dir.rmdir()
            except OSError:  # other ranks' sockets are still there
                pass
