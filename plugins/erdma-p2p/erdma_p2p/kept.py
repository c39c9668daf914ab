"""The data socket a set-up's traversal prepared, kept for this process's next set-ups (an elastic job's
epochs; ``destroy_process_group`` then ``init``). The socket stays bound, so its NAT mapping stays the one the
STUN server reported, and a relay allocation on it stays taken (a TURN server knows an allocation by the
socket's address), so the next set-up neither asks the STUN server nor allocates again, and its peers' relay
permissions and channels are already there.

A transport is handed a duplicate of the socket (``Lease``), which it closes as it would its own socket; the
socket itself stays here until the process exits, when its allocation is released. A socket left unused for
longer than ``KEEP_S`` (or whose relay allocation last heard from it longer ago) is given back at the next
set-up, which gathers anew: a NAT may forget an idle UDP mapping after 30 s (Linux's conntrack forgets an
unanswered flow then), and behind a NAT that maps each destination anew the allocation's way back is then
lost (the relay client's keepalives hold it while a transport uses the socket). One set-up at a time uses a kept
socket (an elastic member's path check beside its epoch gets another).

Not kept: the TCP port's mapping (a NAT keeps one per connection, and those end with the set-up:
``tcp_socket`` learns it again in one round trip), TURN over TCP or TLS (a stream to the server has no
duplicate that shares its framing), and striping lanes' sockets (each goes to a worker process)."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from typing import Any

import attrs

from . import stun
from .relayed import RelayedSocket

log = logging.getLogger("erdma.p2p")
KEEP_S = 25.0  # seconds a kept socket may lie unused and still be lent (a NAT keeps an idle UDP mapping 30 s)
MARGIN_S = 60.0  # a relay allocation with less than this left is not lent: the set-up allocates anew


class Lease(socket.socket):
    """A duplicate of a kept socket's descriptor: the transport's to use and to close; closing it says when
    (``closed_at``), and the kept socket may then be lent again."""

    closed_at: float | None = None

    def close(self) -> None:
        if self.closed_at is None:
            self.closed_at = time.monotonic()
        super().close()


@attrs.define(eq=False)
class Prepared:
    """A data socket with its mapping learned (``sock``: a plain socket, or a ``RelayedSocket`` with a relay
    allocation); never handed out itself."""

    sock: Any
    mapped: stun.Mapped
    lease: Any = None  # the duplicate lent last (every kept socket is lent as it is kept)

    @property
    def relayed(self) -> stun.Mapped | None:
        """The relay allocation's address, if it has one."""
        return self.sock.client.relayed if isinstance(self.sock, RelayedSocket) else None

    def lend(self) -> Any:
        raw = self.sock.sock if isinstance(self.sock, RelayedSocket) else self.sock
        _forget_errors(raw)
        dup = Lease(raw.family, raw.type, raw.proto, fileno=os.dup(raw.fileno()))
        self.lease = self.sock.twin(dup) if isinstance(self.sock, RelayedSocket) else dup
        return self.lease

    def idle(self, now: float) -> float | None:
        """Seconds since the last lease was closed; None while it is in use."""
        closed = self.lease.closed_at  # (a ``Lease``, or a relayed socket's twin on one)
        return None if closed is None else now - closed

    def usable(self, now: float) -> bool:
        """A relay allocation must have time left, and its socket must have sent to the server lately: behind a
        NAT that maps each destination anew, a binding forgotten while idle leaves the allocation unreachable."""
        if isinstance(self.sock, RelayedSocket):
            client = self.sock.client
            return client.usable_until(now) > now + MARGIN_S and now - client.last_sent < KEEP_S
        return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError as exc:
            log.debug("a kept data socket did not close cleanly: %s", exc)


def _forget_errors(sock: socket.socket) -> None:
    """What the last set-up's traffic left on the socket: an ICMP error the kernel queued for it (the transport
    asked for them, ``IP_RECVERR``: a peer's port answered 'unreachable', a network was unreachable) would
    otherwise fail the next set-up's first send, or be taken for news of its peers."""
    sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # (reading the pending error clears it)
    for _ in range(1024):
        try:
            sock.recvmsg(1, 512, socket.MSG_ERRQUEUE)
        except OSError:  # (empty: EAGAIN, also on a blocking socket)
            return


_lock = threading.Lock()
_kept: dict[tuple[Any, ...], list[Prepared]] = {}


def take(key: tuple[Any, ...], now: float) -> tuple[Prepared, Any] | None:
    """A socket kept under ``key`` that no set-up uses now, lent (with the duplicate to hand over); those idle
    past ``KEEP_S``, or whose allocation is running out, are given back on the way. None when there is none."""
    dropped: list[Prepared] = []
    found = None
    with _lock:
        for p in list(_kept.get(key, ())):
            idle = p.idle(now)
            if idle is None:
                continue
            if idle > KEEP_S or not p.usable(now):
                _kept[key].remove(p)
                dropped.append(p)
            elif found is None:
                found = (p, p.lend())
    for p in dropped:  # outside the lock: a relay's close sends its release
        p.close()
    return found


def keep(key: tuple[Any, ...], prepared: Prepared) -> Any:
    """Keep ``prepared`` under ``key``; the duplicate to hand over for this set-up."""
    with _lock:
        _kept.setdefault(key, []).append(prepared)
        return prepared.lend()


def release() -> None:
    """Give back every kept socket (their relay allocations released): at exit, and for tests."""
    with _lock:
        every = [p for ps in _kept.values() for p in ps]
        _kept.clear()
    for p in every:
        p.close()


def _forget() -> None:
    """In a forked child: the parent's kept sockets are the parent's (a child's release would end their
    allocations); the child gathers its own."""
    global _lock
    _lock = threading.Lock()
    _kept.clear()


atexit.register(release)
os.register_at_fork(after_in_child=_forget)
