"""A striping worker: one process, one UDP socket, one QUIC connection to the same lane of every other
rank, carrying the parts of large messages its rank hands it (``lanes``). Started by the rank as
``python -m erdma_quic.lane_worker FD [DATA_FD]``; FD is its end of a socket pair that carries small pickled
messages (payload travels in ``parcels``); DATA_FD, when given, is the lane's UDP socket as the traversal
prepared it (else the worker binds one). Its connections are a ``mesh.Mesh`` like the rank's, authenticated the
same way; its parts go to a ``Sink`` (back to the rank, whole) instead of a mailbox.

Rank to worker: ``{"opts", "rank", "world", "job", "lane", "bind", "owner", "timeout"}``, then
``("peers", {rank: (host, port)})`` with the lane addresses of the ranks it dials, then any number of
``("send", id, peer, head, parcel)`` and one ``("close", seconds)`` (how long it may wait for what it sent to be
acknowledged). Worker to rank: ``("port", n)``, ``("ready",)``
or ``("error", text)``, then ``("sent", id, error or None)``, ``("part", peer, head, parcel)``,
``("lost", peer, why)``, and ``("closed",)``. The worker exits when its rank's end of the socket closes.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from erdma_core.sdk import CollectiveTimeoutError, ErdmaError, PeerLostError, ProtocolError, Request
from erdma_core.toolkit import running

from . import congestion as _congestion  # noqa: F401  registers "bbr" with aioquic
from . import parcels, tls
from .endpoint import Endpoint
from .mesh import Event, Joined, Lost, Mesh, Refused
from .streams import Inbound
from .transport import connection_for, settings

log = logging.getLogger("erdma.quic")


class _Notify(Request):
    """A lane send: tells the rank when QUIC has the part (or why it never will)."""

    __slots__ = ("ident", "report")

    def __init__(self, report: Any, ident: int) -> None:
        super().__init__()
        self.report, self.ident = report, ident

    def complete(self, error: BaseException | None = None) -> None:
        if not self.done():
            super().complete(error)
            self.report(("sent", self.ident, None if error is None else str(error)))


class Sink:
    """Each incoming part into a parcel of its own; the rank puts it in place."""

    def __init__(self, owner: int, lane: int, report: Any) -> None:
        self.owner, self.lane, self.report = owner, lane, report

    def open_part(self, peer: int, head: bytes, length: int) -> tuple[memoryview, object]:
        name, view = parcels.new(self.owner, f"in{self.lane}", length)
        return view, (peer, head, name)

    def part_landed(self, token: object) -> None:
        peer, head, name = token  # type: ignore[misc]
        self.report(("part", peer, head, name))


class Lane:
    """One worker's QUIC side: the mesh, its endpoint, and the control socket to the rank."""

    def __init__(self, setup: dict[str, Any], control: Connection) -> None:
        self.setup, self.control = setup, control
        self.rank, self.lane = setup["rank"], setup["lane"]
        self._write = threading.Lock()
        self.stopped = threading.Event()
        self.joined: set[int] = set()
        self.refused: dict[int, str] = {}
        self.closing = False
        creds = tls.load(setup["opts"], setup["rank"], setup["job"])
        sink = Sink(setup["owner"], self.lane, self.report)
        self.mesh = Mesh(settings(setup["opts"], setup["rank"], setup["world"], setup["job"], creds.verify),
                         creds.configure, creds.identify, lambda peer: Inbound(peer, None, lambda h: None, sink),
                         connection=connection_for(setup["opts"]))
        self.endpoint: Endpoint | None = None

    def report(self, message: tuple[Any, ...]) -> None:
        with self._write:
            try:
                self.control.send(message)
            except OSError:  # the rank is gone; the control reader stops everything
                pass

    def start(self, sock: socket.socket, peers: dict[int, tuple[str, int]], timeout: float) -> None:
        self.endpoint = ep = Endpoint(sock, self.mesh, self._on_event, f"erdma-quic-{self.rank}-lane{self.lane}",
                                      gso=self.setup["opts"]["gso"])
        deadline = time.monotonic() + timeout
        for peer, addr in sorted(peers.items()):
            ep.call(self.mesh.dial, peer, addr, ep.now)
        want = set(range(self.setup["world"])) - {self.rank}
        while want - self.joined:
            if self.refused:
                raise ProtocolError(f"lane {self.lane}: {next(iter(self.refused.values()))}")
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(f"lane {self.lane}: ranks {sorted(want - self.joined)} did not connect")
            time.sleep(0.01)
        ep.call(self.mesh.start_keepalive, ep.now)
        ep.loop.call_soon_threadsafe(ep.loop.add_reader, self.control.fileno(), self._command)

    def _on_event(self, ev: Event) -> None:
        if isinstance(ev, Joined):
            self.joined.add(ev.peer)
        elif isinstance(ev, Refused):
            self.refused[ev.peer] = f"rank {ev.peer} at {ev.addr}: {ev.why}"
        elif isinstance(ev, Lost):
            self.mesh.fail(ev.peer, PeerLostError(f"lane {self.lane}: {ev.why}", peer=ev.peer, rank=self.rank))
            if not self.closing:
                self.report(("lost", ev.peer, ev.why))

    # ---- commands from the rank (on the loop thread) -------------------------------------------------
    def _command(self) -> None:
        assert self.endpoint is not None
        try:
            while self.control.poll(0):
                msg = self.control.recv()
                if msg[0] == "send":
                    _, ident, peer, head, name = msg
                    self.mesh.send(peer, [(head, parcels.take(name))], _Notify(self.report, ident))
                elif msg[0] == "close":
                    self.closing = True
                    self._drain(int(msg[1] * 100))
        except (EOFError, OSError):
            self.closing = True
            self.stopped.set()
        self.endpoint.pump()

    def _drain(self, tries: int) -> None:
        """Close once every part handed over has been acknowledged (or after ``tries`` * 10 ms)."""
        ep = self.endpoint
        assert ep is not None
        if not self.mesh.flushed() and tries > 0:
            ep.loop.call_later(0.01, self._drain, tries - 1)
            return
        self.mesh.close(ep.now)
        ep.pump()
        self.report(("closed",))
        ep.loop.call_later(0.05, self.stopped.set)


def main(fd: int, data_fd: int | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    control = Connection(fd)
    setup = control.recv()
    try:
        return _serve(control, setup, data_fd)
    finally:
        if not running(setup["owner"]):  # its rank is gone: nobody will take what it was handed
            parcels.sweep(setup["owner"])


def _serve(control: Connection, setup: dict[str, Any], data_fd: int | None) -> int:
    if data_fd is not None:  # prepared by the traversal (its NAT mapping learned): used as it is
        sock = socket.socket(fileno=data_fd)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((setup["bind"], 0))
    control.send(("port", sock.getsockname()[1]))
    try:
        lane = Lane(setup, control)
        msg = control.recv()
        lane.start(sock, msg[1], setup["timeout"])
    except (EOFError, OSError):
        return 1
    except ErdmaError as exc:
        control.send(("error", str(exc)))
        return 1
    lane.report(("ready",))
    lane.stopped.wait()
    try:
        if lane.endpoint is not None:
            lane.endpoint.stop()
    finally:
        if not running(setup["owner"]):
            parcels.sweep(setup["owner"])
        os._exit(0)  # the rank may already be gone: no interpreter teardown that could block on it


if __name__ == "__main__":
    sys.exit(main(*map(int, sys.argv[1:3])))
