"""A striping worker: one process, one UDP socket, one QUIC connection to the same lane of every other
rank, carrying the parts of large messages its rank hands it (``lanes``). Started by the rank as
``python -m erdma_quic.lane_worker FD``; FD is its end of a socket pair that carries small pickled messages
(payload travels in ``parcels``).

Rank to worker: ``{"opts", "rank", "world", "job", "lane", "bind", "owner", "timeout"}``, then
``("peers", {rank: (host, port)})`` with the lane addresses of the ranks it dials, then any number of
``("send", id, peer, head, parcel)`` and one ``("close",)``. Worker to rank: ``("port", n)``, ``("ready",)``
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

from erdma_core.errors import ErdmaError, PeerLostError
from erdma_core.transport.mailbox import Mailbox, Request

from . import parcels
from .endpoint import Endpoint
from .link import Link, Outgoing
from .transport import QuicTransport

log = logging.getLogger("erdma.quic")


class _Notify(Request):
    """A lane send: tells the rank when QUIC has the part (or why it never will)."""

    __slots__ = ("ident", "lane")

    def __init__(self, lane: LaneTransport, ident: int) -> None:
        super().__init__()
        self.lane, self.ident = lane, ident

    def complete(self, error: BaseException | None = None) -> None:
        if not self.done():
            super().complete(error)
            self.lane.report(("sent", self.ident, None if error is None else str(error)))


class _Sink:
    """Each incoming part into a parcel of its own; the rank puts it in place."""

    def __init__(self, lane: LaneTransport) -> None:
        self.lane = lane

    def open_part(self, peer: int, head: bytes, length: int) -> tuple[memoryview, object]:
        name, view = parcels.new(self.lane.owner, f"in{self.lane.lane}", length)
        return view, (peer, head, name)

    def part_landed(self, token: object) -> None:
        peer, head, name = token  # type: ignore[misc]
        self.lane.report(("part", peer, head, name))


class LaneTransport(QuicTransport):
    """The QUIC machinery of a rank (authentication, links, reconnection), minus the mailbox: parts come
    from the rank and go back to it whole. Never sends control frames; its rank's main connection does."""

    def __init__(self, setup: dict[str, Any], control: Connection) -> None:
        super().__init__(None, setup["opts"])
        self.rank, self.world_size, self.job = setup["rank"], setup["world"], setup["job"]
        self.lane, self.owner = setup["lane"], setup["owner"]
        self.mailbox = Mailbox(self.rank, self.job)  # identifies peers; data never reaches it
        self.sink = _Sink(self)
        self.control = control
        self._write = threading.Lock()
        self.stopped = threading.Event()

    def report(self, message: tuple[Any, ...]) -> None:
        with self._write:
            try:
                self.control.send(message)
            except OSError:  # the rank is gone; the control reader stops everything
                pass

    def start(self, sock: socket.socket, peers: dict[int, tuple[str, int]], timeout: float) -> None:
        self._credentials()
        self.endpoint = Endpoint(sock, self._accept, f"erdma-quic-{self.rank}-lane{self.lane}",
                                 gso=self.opts["gso"])
        deadline = time.monotonic() + timeout
        for peer, addr in sorted(peers.items()):
            self.endpoint.run_sync(self._dial, peer, addr)
        self._wait_all(deadline, timeout)
        self.endpoint.call(self._keepalive)
        self.endpoint.loop.call_soon_threadsafe(self.endpoint.loop.add_reader, self.control.fileno(), self._command)

    # ---- commands from the rank (on the loop thread) -------------------------------------------------
    def _command(self) -> None:
        try:
            while self.control.poll(0):
                msg = self.control.recv()
                if msg[0] == "send":
                    _, ident, peer, head, name = msg
                    self._send(ident, peer, head, name)
                elif msg[0] == "close":
                    self.closing = True
                    self._drain(500)
        except (EOFError, OSError):
            self._stop()

    def _send(self, ident: int, peer: int, head: bytes, name: str) -> None:
        req = _Notify(self, ident)
        link = self.links.get(peer)
        if link is None:
            req.complete(PeerLostError(f"lane {self.lane} has no connection to rank {peer}", peer=peer))
            return
        link.enqueue(Outgoing([(head, parcels.take(name))], req))

    def _drain(self, tries: int) -> None:
        """Close once every part handed over has been acknowledged (or after ``tries`` * 10 ms)."""
        busy = any(link.queue or (link.session is not None and link.session.open_streams
                                  and not link.session.terminated) for link in self.links.values() if not link.dead)
        if busy and tries > 0:
            self.endpoint.loop.call_later(0.01, self._drain, tries - 1)
            return
        self._close_all()
        self.report(("closed",))
        self.endpoint.loop.call_later(0.05, self._stop)

    def _stop(self) -> None:
        self.closing = True
        self.stopped.set()

    # ---- what the base transport does differently on a lane --------------------------------------------
    def lost(self, link: Link, why: str) -> None:
        if link.dead:
            return
        link.fail(PeerLostError(f"lane {self.lane}: {why}", peer=link.rank, rank=self.rank))
        if not self.closing:
            self.report(("lost", link.rank, why))


def main(fd: int) -> int:
    control = Connection(fd)
    setup = control.recv()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((setup["bind"], 0))
    control.send(("port", sock.getsockname()[1]))
    lane = LaneTransport(setup, control)
    try:
        msg = control.recv()
        lane.start(sock, msg[1], setup["timeout"])
    except (EOFError, OSError):
        return 1
    except ErdmaError as exc:
        lane.report(("error", str(exc)))
        return 1
    lane.report(("ready",))
    lane.stopped.wait()
    try:
        lane.endpoint.stop()
    finally:
        os._exit(0)  # the rank may already be gone: no interpreter teardown that could block on it


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
