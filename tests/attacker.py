"""An outsider without the secret, run as a process of its own by tests/test_lockout.py:

    python tests/attacker.py --slow-targets 127.0.0.1:5000 --flood-targets 127.0.0.1:5000,127.0.0.1:5001 \\
        --sources 127.0.0.2,127.0.0.3 --slow 200 --flood 2000 --seconds 60

``--slow`` connections, opened ``--slow-rate`` a second, that send one byte every 2 s once connected (one
the server closes is opened again half a second later), and ``--flood`` new connections a second that send
nothing and are closed 0.2 s later, each kind spread over its targets and bound to the source addresses in
turn. Nothing blocks: one loop drives them all. Prints ``slow N`` once N slow connections have connected,
then a line a second with what it has done. It reads only to learn that a connection was closed."""

from __future__ import annotations

import argparse
import errno
import itertools
import resource
import selectors
import socket
import struct
import time

_ABORT = struct.pack("ii", 1, 0)


def _open(target: tuple[str, int], source: str) -> socket.socket | None:
    """A non-blocking connection from ``source`` to ``target``, on its way (or None)."""
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError:  # out of descriptors for a moment
        return None
    sock.setblocking(False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT)  # closed with a reset: no TIME_WAIT left holding
    try:  # its port, which would keep later tests' servers from binding it on every address
        sock.bind((source, 0))
        err = sock.connect_ex(target)
    except OSError:
        err = -1
    if err not in (0, errno.EINPROGRESS):
        sock.close()
        return None
    return sock


class _Slow:
    __slots__ = ("connected", "due")

    def __init__(self, due: float) -> None:
        self.connected, self.due = False, due


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slow-targets", required=True)
    ap.add_argument("--flood-targets", required=True)
    ap.add_argument("--sources", required=True)
    ap.add_argument("--slow", type=int, default=200)
    ap.add_argument("--slow-rate", type=float, default=100.0)
    ap.add_argument("--flood", type=float, default=2000.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 1 << 16)), hard))  # the flood's sockets
    sources = args.sources.split(",")
    slow_places, flood_places = (
        itertools.cycle([((h, int(p)), s) for h, p in (t.rsplit(":", 1) for t in targets.split(",")) for s in sources])
        for targets in (args.slow_targets, args.flood_targets))
    sel = selectors.DefaultSelector()
    slow: dict[socket.socket, _Slow] = {}
    closed: list[float] = []  # when slow ones were closed (each is opened again 0.5 s later)
    flood: list[tuple[float, socket.socket]] = []
    start = time.monotonic()
    end, said, flooded, connected, sent, opened = start + args.seconds, start, 0, 0, 0, 0
    announced = False
    while (now := time.monotonic()) < end:
        while (len(slow) < args.slow and (not closed or closed[0] <= now - 0.5)
               and opened < (now - start) * args.slow_rate):  # (re)open the slow ones, at their rate
            if closed:
                closed.pop(0)
            sock = _open(*next(slow_places))
            if sock is None:
                break
            opened += 1
            slow[sock] = _Slow(now + 2.0)
            sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        due = int((now - start) * args.flood) - flooded  # the flood, at its rate
        for _ in range(max(0, min(due, 500))):
            sock = _open(*next(flood_places))
            flooded += 1
            if sock is not None:
                flood.append((now + 0.2, sock))
        while flood and flood[0][0] <= now:
            flood.pop(0)[1].close()
        for sock, state in slow.items():
            if state.connected and state.due <= now:
                try:
                    sent += sock.send(b"E")
                except OSError:
                    pass
                state.due = now + 2.0
        for key, events in sel.select(0.005):
            sock = key.fileobj  # type: ignore[assignment]
            state = slow[sock]
            if events & selectors.EVENT_WRITE and not state.connected:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    state.connected = True
                    connected += 1
                    sel.modify(sock, selectors.EVENT_READ)
                    continue
            elif events & selectors.EVENT_READ:  # closed (or bytes it is sent, never used): open it again
                try:
                    if sock.recv(1 << 16):
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
            else:
                continue
            sel.unregister(sock)
            del slow[sock]
            sock.close()
            closed.append(now)
        if not announced and connected >= args.slow:
            print(f"slow {args.slow}", flush=True)
            announced = True
        if now - said >= 1.0:
            said = now
            print(f"open {sum(s.connected for s in slow.values())} slow, {flooded} flooded, {connected} slow "
                  f"connected, {sent} bytes", flush=True)


if __name__ == "__main__":
    main()
