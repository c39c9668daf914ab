"""Single-copy transfers between ranks of one host (Linux cross-memory attach, ``process_vm_readv``).

Over a Unix socket a message is copied twice: the sender's ``sendmsg`` into the kernel, the receiver's
``recv_into`` out of it. Between ranks that may read each other's memory, a large message is lent instead:
the sender sends only where it lies (a PULL frame), the receiver reads it straight into the receive's memory
with one ``process_vm_readv`` once that receive is posted, and tells the sender its memory is free again
(PULLED). The sender's CPU does no copy at all.

Whether a peer may read this rank's memory is the kernel's decision (same user, ``ptrace`` access: Yama's
``ptrace_scope`` or a container's pid namespace may forbid it), so it is tried once per connection at set-up
(``probe``): each rank shows a random token in its memory, the peer reads it and sends back what it read,
and a rank lends only to a peer that read its token right. The peer's process id comes from the kernel
(``SO_PEERCRED``), never from the peer's word. Everything else keeps the socket.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import struct
import sys
import time
from collections.abc import Iterable

import numpy as np

from ...net.sockets import recv_exact

_TOKEN = 16
_OFFER = struct.Struct("<QQ")  # address of this rank's token, its length
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc_call() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.process_vm_readv  # ctypes releases the GIL for the call
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.c_ulong]
    return fn


_readv = _libc_call()


def available() -> bool:
    """Whether this platform has ``process_vm_readv`` at all."""
    return _readv is not None


def address_of(view: memoryview) -> int:
    """Where ``view``'s bytes start in this process (read-only memory too)."""
    return int(np.frombuffer(view, np.uint8).ctypes.data) if view.nbytes else 0


def read(pid: int, address: int, out: memoryview) -> None:
    """Copy ``out.nbytes`` bytes at ``address`` in process ``pid`` into ``out`` (writable, contiguous).
    Raises OSError (EPERM: not allowed; EFAULT: no such memory there; ESRCH: no such process)."""
    if _readv is None:
        raise OSError(38, "process_vm_readv is not available on this platform")
    n = out.nbytes
    if not n:
        return
    local = address_of(out)
    done = 0
    while done < n:  # the kernel may copy less than asked (it stops at a page it cannot reach)
        liov = _IoVec(local + done, n - done)
        riov = _IoVec(address + done, n - done)
        got = _readv(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from process {pid}: {os.strerror(err)}")
        if got == 0:
            raise OSError(14, f"process_vm_readv from process {pid}: nothing readable at {address + done:#x}")
        done += got


def peer_pid(sock: socket.socket) -> int:
    """The process at the other end of a connected Unix socket, as the kernel saw it connect (0: unknown,
    e.g. a process in a pid namespace this one cannot see)."""
    try:
        return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[0]
    except (OSError, AttributeError):
        return 0


def probe(socks: dict[int, socket.socket], deadline: float) -> tuple[set[int], dict[int, int]]:
    """Find out, with every peer in ``socks`` (connected Unix sockets, in blocking mode, before any frame),
    which peers can read this rank's memory and whose memory this rank can read. Both ends must call it
    with each other at the same point of set-up. Returns ``(peers to lend to, {peer: pid} to read from})``.
    Raises ``Unanswered`` (naming the peer) when a peer stops answering: a dead peer fails set-up."""
    token = bytearray(os.urandom(_TOKEN))
    offer = _OFFER.pack(address_of(memoryview(token)), _TOKEN)
    for peer, sock in socks.items():  # small writes first on every socket, then reads: no end waits on the other
        _send(peer, sock, offer, deadline)
    readable: dict[int, int] = {}
    for peer, sock in socks.items():
        address, length = _OFFER.unpack(_recv(peer, sock, _OFFER.size, deadline))
        seen = bytearray(_TOKEN)
        pid = peer_pid(sock)
        if pid > 0 and length == _TOKEN and available():
            try:
                read(pid, address, memoryview(seen))
                readable[peer] = pid
            except OSError:
                seen[:] = bytes(_TOKEN)
        _send(peer, sock, bytes(seen), deadline)
    lend = {peer for peer, sock in socks.items() if _recv(peer, sock, _TOKEN, deadline) == bytes(token)}
    return lend, readable


class Unanswered(ConnectionError):
    """A peer stopped answering the probe (``peer``: its rank)."""

    def __init__(self, peer: int, why: BaseException) -> None:
        super().__init__(f"rank {peer} stopped answering: {why}")
        self.peer = peer


def _send(peer: int, sock: socket.socket, data: bytes, deadline: float) -> None:
    try:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        sock.sendall(data)
    except OSError as exc:
        raise Unanswered(peer, exc) from None


def _recv(peer: int, sock: socket.socket, n: int, deadline: float) -> bytes:
    try:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        return recv_exact(sock, n)
    except OSError as exc:  # ConnectionError and socket timeouts are OSErrors
        raise Unanswered(peer, exc) from None


def peers_of(socks: Iterable[tuple[int, socket.socket]]) -> dict[int, socket.socket]:
    """The Unix-socket connections among ``socks`` (the only ones whose ends share a host for certain)."""
    return {peer: sock for peer, sock in socks if sock.family == socket.AF_UNIX}
