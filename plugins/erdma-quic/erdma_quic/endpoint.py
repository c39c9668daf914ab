"""The I/O adapters of a ``mesh.Mesh``: one UDP socket whose datagrams and time they move between the
socket and the mesh, ICMP errors turned into ``Mesh.unreachable``, the mesh's events handed to ``on_event``;
nothing protocol-shaped happens here. ``UdpPort`` is the socket side both share. ``Endpoint`` runs the mesh on
an asyncio loop in a thread of its own, which other threads reach through ``call`` and ``run_sync`` (a
striping lane's worker process); ``driver.Driver`` lets the threads that wait drive it themselves (a rank).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from .gso import GsoPaths
from .mesh import Event, Mesh
from .ngtcp2 import connection as shim

log = logging.getLogger("erdma.quic")
_IP_RECVERR = 11
_IP_MTU = 14
_RECV_BATCH = 256  # datagrams read per wake-up before the mesh gets to answer
_UDP_SEGMENT = 103  # linux/udp.h: GSO segment size for one sendmsg
_GSO_REFUSED = {errno.EIO, errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP}
_UDP_GRO = 104  # linux/udp.h: this socket takes datagrams the kernel coalesced (their size in a control message)
_RX_BATCH, _RX_STRIDE = 64, 65536  # datagrams per recvmmsg, bytes each may take
_GSO_MAX = 65000  # one GSO send is one IP packet before segmentation: at most 64 KiB


def path_mtu(addr: tuple[str, int]) -> int:
    """The MTU the kernel knows for the route to ``addr`` (the interface's, until PMTU learns more)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(addr)
        return int(s.getsockopt(socket.IPPROTO_IP, _IP_MTU))
    except OSError:
        return 1500
    finally:
        s.close()


def datagram_size(addr: tuple[str, int], configured: int) -> int:
    """Largest QUIC datagram for ``addr``: the configured size, or (0) the path MTU less IPv4 and UDP
    headers, capped at 16000 bytes (aioquic writes a STREAM frame's length in two bytes)."""
    if configured:
        return configured
    return max(1200, min(path_mtu(addr) - 28, 16000))


class UdpPort:
    """The socket side of a mesh's adapter: non-blocking, ICMP errors queued, large buffers, UDP GSO on the
    paths a probe proved (``gso``), answers to other ports' probes (always)."""

    def __init__(self, sock: socket.socket, mesh: Mesh, on_event: Callable[[Event], None], gso: bool) -> None:
        """``on_event(event)`` runs for every event the mesh reports, wherever the mesh is being driven."""
        self.sock, self.mesh, self.on_event = sock, mesh, on_event
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.IPPROTO_IP, _IP_RECVERR, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
        self.send_drops = 0
        self.gso = gso and hasattr(socket, "SOL_UDP")
        self.gso_paths = GsoPaths(self._gso_verdict)
        # batches go straight to the socket's descriptor: only for a plain UDP socket (a relayed one wraps and
        # unwraps each datagram itself)
        self._batch = shim.loaded() if isinstance(sock, socket.socket) else None
        self._v4 = self._batch is not None and sock.family == socket.AF_INET  # (recvmmsg's addresses: IPv4)
        self._rx: tuple[Any, Any, Any, Any] | None = None  # recvmmsg's buffers, made on first use
        # the compiled engine's receive fast path: its connections' datagrams go to them in C
        self._demux = getattr(mesh.connection, "demux", None) if self._batch is not None else None
        self._runs = self._batch is not None and hasattr(mesh.connection, "runs")
        if self._runs:
            mesh.connection.runs = True  # its connections hand this side whole batches (shim.Run) to send
        if self._demux is not None and self._v4:
            try:  # the demux splits what the kernel coalesced (a GSO sender's runs arrive as one message)
                sock.setsockopt(socket.SOL_UDP, _UDP_GRO, 1)
            except OSError as exc:
                log.debug("UDP GRO unavailable: %s", exc)

    @property
    def now(self) -> float:
        """The mesh's clock (asyncio's loop time is the same clock)."""
        return time.monotonic()

    def read(self) -> int:
        """Hand the mesh what the socket holds (at most a batch), each datagram with the time it was read;
        returns how many datagrams that was."""
        if self._v4:
            return self._read_demuxed() if self._demux is not None else self._read_batches()
        n = 0
        for _ in range(_RECV_BATCH):
            try:
                data, addr = self.sock.recvfrom(65536)
            except BlockingIOError:
                break
            except OSError:
                self._read_errors()
                continue
            self._deliver(data, addr, self.now)
            n += 1
        return n

    def _read_batches(self) -> int:
        """``read`` with ``recvmmsg`` (erdma_quic.ngtcp2's C helper): one system call per batch."""
        ffi, lib = self._batch
        if self._rx is None:
            self._rx = (ffi.new("uint8_t[]", _RX_BATCH * _RX_STRIDE), ffi.new("size_t[]", _RX_BATCH),
                        ffi.new("char[]", 46 * _RX_BATCH), ffi.new("int[]", _RX_BATCH))
        buf, lens, hosts, ports = self._rx
        view = ffi.buffer(buf)
        n = 0
        names: dict[bytes, str] = {}
        for _ in range(_RECV_BATCH // _RX_BATCH + 4):  # a few more turns for errors in the way
            if n >= _RECV_BATCH:
                break
            got = lib.eq_recvmmsg(self.sock.fileno(), buf, _RX_STRIDE, lens, _RX_BATCH, hosts, ports)
            if got < 0:
                if got != -errno.EINTR:
                    self._read_errors()  # an ICMP error stood first in line (or the socket is closing)
                continue
            now = self.now
            for i in range(got):
                raw = ffi.string(hosts + 46 * i)
                host = names.get(raw) or names.setdefault(raw, raw.decode())
                at = i * _RX_STRIDE
                self._deliver(view[at:at + lens[i]], (host, ports[i]), now)
            n += got
            if got < _RX_BATCH:
                break
        return n

    def _read_demuxed(self) -> int:
        """``read`` through the compiled engine's ``Demux``: datagrams of its connections go to them in C, the
        mesh hears which connections took some; the rest go to the mesh one by one."""
        n = 0
        for _ in range(_RECV_BATCH // _RX_BATCH + 4):  # a few more turns for errors in the way
            if n >= _RECV_BATCH:
                break
            now = self.now
            got, touched, others = self._demux.receive(self.sock.fileno(), now)
            if got < 0:
                if got != -errno.EINTR:
                    self._read_errors()  # an ICMP error stood first in line (or the socket is closing)
                continue
            for token in touched:
                self.mesh.heard(token, now)
            for data, addr in others:
                self._deliver(data, addr, now)
            n += got
            if got < _RX_BATCH:
                break
        return n

    def flush(self) -> None:
        """Send what the mesh has and hand its events on (which may give it more to send)."""
        mesh = self.mesh
        while True:
            self._transmit(mesh.datagrams_to_send(self.now))
            ev = mesh.next_event()
            if ev is None:
                return
            while ev is not None:
                self.on_event(ev)
                ev = mesh.next_event()

    def _read_errors(self) -> None:
        """Drain the socket's error queue: the mesh hears of every peer whose port answered 'unreachable'."""
        while True:
            try:
                _, _, _, addr = self.sock.recvmsg(64, 512, socket.MSG_ERRQUEUE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self.mesh.unreachable(addr, self.now)

    def _transmit(self, out: list[tuple[Any, Any]]) -> None:
        if self._runs:
            rest = []
            for data, addr in out:
                if isinstance(data, shim.Run):
                    self._send_run(data, addr)
                else:
                    rest.append((data, addr))
            out = rest
        if self.gso and len(out) > 1:
            out = self._send_gso_runs(out)
        if self._batch is not None and len(out) > 2:
            self._send_runs(out)
            return
        for data, addr in out:
            self._send(data, addr)

    def _send_gso_runs(self, out: list[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
        """UDP GSO: runs of equal-size datagrams to one address (the last may be shorter) in one sendmsg each,
        where the path is proven; returns the datagrams left to send one by one."""
        rest = []
        i = 0
        while i < len(out):
            data, addr = out[i]
            size, j, total = len(data), i + 1, len(data)
            while (j < len(out) and out[j][1] == addr and len(out[j][0]) <= size and total + len(out[j][0]) <= _GSO_MAX
                   and len(out[j - 1][0]) == size):
                total += len(out[j][0])
                j += 1
            if j - i > 1 and self._gso_to(addr, size):
                self._send_gso(b"".join(d for d, _ in out[i:j]), size, addr, out[i:j])
            else:
                rest.extend(out[i:j])
            i = j
        return rest

    def _send_runs(self, out: list[tuple[bytes, Any]]) -> None:
        """Runs of datagrams to one address in one ``sendmmsg`` each (erdma_quic.ngtcp2's C helper)."""
        ffi, lib = self._batch
        i = 0
        while i < len(out):
            addr = out[i][1]
            j = i + 1
            while j < len(out) and out[j][1] == addr:
                j += 1
            if j - i == 1:
                self._send(out[i][0], addr)
            else:
                run = [d for d, _ in out[i:j]]
                lens = ffi.new("size_t[]", [len(d) for d in run])
                sent = lib.eq_sendmmsg_packed(self.sock.fileno(), b"".join(run), lens, len(run), addr[0].encode(),
                                              addr[1])
                if sent < len(run):
                    self._read_errors()  # as in _send_run
                    if sent != -errno.ECONNREFUSED:
                        self.send_drops += len(run) - max(sent, 0)  # QUIC's loss recovery resends them
            i = j

    def _send_run(self, run: shim.Run, addr: Any) -> None:
        """One engine batch (datagrams for ``addr``) in one ``sendmmsg``; with ``gso``, its runs of full-size
        datagrams as one message each (UDP GSO)."""
        _, lib = self._batch
        args = (self.sock.fileno(), run.blob, run.stride, run.lens, run.count, addr[0].encode(), addr[1])
        if self.gso and self._gso_to(addr, run.stride):
            sent = lib.eq_sendmmsg_gso(*args)
            if -sent in _GSO_REFUSED:  # the socket or the device cannot cut GSO messages
                log.info("UDP GSO unavailable (%s); sending datagrams one by one", os.strerror(-sent))
                self.gso = False
                sent = lib.eq_sendmmsg(*args)
        else:
            sent = lib.eq_sendmmsg(*args)
        run.release()
        if sent < run.count:
            # a port's 'unreachable' may have come back while the batch went (loopback answers at once):
            # sendmmsg then stops and keeps only the count, so the error queue says whose
            self._read_errors()
            if sent != -errno.ECONNREFUSED:
                self.send_drops += run.count - max(sent, 0)  # QUIC's loss recovery resends them

    def _gso_to(self, addr: Any, size: int) -> bool:
        """Whether a run of ``size``-byte datagrams to ``addr`` goes as GSO messages (a probe goes first where
        one is due)."""
        use, probe = self.gso_paths.use(addr, size, self.now)
        if probe is not None:
            self._send_gso(probe, size, addr, [])
        return use and self.gso

    def _gso_verdict(self, addr: Any, proven: bool) -> None:
        if proven:
            log.debug("UDP GSO to %s:%s: the probe came back whole", *addr[:2])
        else:
            log.info("UDP GSO to %s:%s: no probe came back whole; datagrams go one by one on this path (tried "
                     "again in a minute)", *addr[:2])

    def _deliver(self, data: bytes, addr: Any, now: float) -> None:
        """A datagram the socket side reads itself: to the mesh, unless its first byte is 0 (no QUIC packet):
        then a GSO probe gets its answer and an answer counts for its round."""
        if data[:1] != b"\x00":
            self.mesh.receive(data, addr, now)
            return
        answer = self.gso_paths.on_datagram(data, now)
        if answer is not None:
            self._send(answer, addr)

    def _send(self, data: bytes, addr: Any) -> None:
        try:
            self.sock.sendto(data, addr)
        except BlockingIOError:
            self.send_drops += 1  # QUIC's loss recovery resends it
        except OSError as exc:
            if exc.errno == errno.ECONNREFUSED:
                self._read_errors()  # an earlier datagram's 'unreachable': the error queue says whose
            else:
                log.debug("sendto %s: %s", addr, exc)

    def _send_gso(self, blob: bytes, size: int, addr: Any, parts: list[tuple[bytes, Any]]) -> None:
        try:
            self.sock.sendmsg([blob], [(socket.SOL_UDP, _UDP_SEGMENT, struct.pack("=H", size))], 0, addr)
        except BlockingIOError:
            self.send_drops += len(parts)
        except OSError as exc:
            if exc.errno == errno.ECONNREFUSED:
                self._read_errors()
                return
            log.info("UDP GSO unavailable (%s); sending datagrams one by one", exc)
            self.gso = False
            for data, a in parts:
                self._send(data, a)


class Endpoint(UdpPort):
    def __init__(self, sock: socket.socket, mesh: Mesh, on_event: Callable[[Event], None], name: str,
                 gso: bool = False) -> None:
        """``on_event(event)`` runs on the loop thread for every event the mesh reports."""
        super().__init__(sock, mesh, on_event, gso)
        self.loop = asyncio.new_event_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- thread bridge -------------------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.add_reader(self.sock.fileno(), self._readable)
        self.loop.run_forever()
        self.loop.remove_reader(self.sock.fileno())
        self.loop.close()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread soon (from any thread), then let the mesh act on it."""
        try:
            self.loop.call_soon_threadsafe(self._do, fn, args)
        except RuntimeError:  # loop closed: the transport is shutting down
            pass

    def run_sync(self, fn: Callable[..., Any], *args: Any, timeout: float = 5.0) -> Any:
        """Run ``fn(*args)`` on the loop thread and return its result (from another thread)."""
        if threading.current_thread() is self._thread:
            return self._do(fn, args)
        done: cf.Future[Any] = cf.Future()

        def job() -> None:
            try:
                done.set_result(self._do(fn, args))
            except BaseException as exc:
                done.set_exception(exc)
        self.loop.call_soon_threadsafe(job)  # RuntimeError once the loop is closed
        return done.result(timeout)

    def _do(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        result = fn(*args)
        self.pump()
        return result

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.call(self.loop.stop)
        self._thread.join(5.0)
        self.sock.close()

    # ---- the mesh -------------------------------------------------------------------------------------
    def pump(self) -> None:
        """Send what the mesh has, hand its events on, re-arm its timer."""
        self.flush()
        at = self.mesh.get_timer()
        if at != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = at
            self._timer = self.loop.call_at(at, self._on_timer) if at is not None else None

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self.mesh.handle_timer(self.now)
        self.pump()

    def _readable(self) -> None:
        self.read()
        self.pump()
