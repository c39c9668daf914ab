"""Payload handed between a rank and its striping workers (``lanes``) through files in shared memory
(``/dev/shm``): the writer fills a file of its own, names it in a small message over the control socket,
and the reader maps it and unlinks it at once, so the bytes are copied once each way and a file outlives
neither side. Names carry the rank process's pid, so whatever a failure left behind is swept: by the rank
at close and when it exits without closing, by its workers when they find the rank gone, and by the next
rank on the host that stripes (``sweep_dead``).
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import tempfile
from pathlib import Path

from erdma_core.toolkit import running

_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
_counter = itertools.count()


_PREFIX = "erdma-quic-"


def prefix(owner_pid: int) -> str:
    return f"{_PREFIX}{owner_pid}-"


def _name(owner_pid: int, tag: str) -> str:
    """A name no other parcel has: pids are reused (pid_max may be 32768), and a process killed before it
    swept leaves its parcels behind, so a random part keeps a new process from meeting an old name."""
    return f"{prefix(owner_pid)}{tag}-{os.getpid()}-{_nonce}-{next(_counter)}"


_nonce = secrets.token_hex(6)


def _new_nonce() -> None:
    global _nonce
    _nonce = secrets.token_hex(6)


os.register_at_fork(after_in_child=_new_nonce)  # a forked child must not share its parent's names


def new(owner_pid: int, tag: str, length: int) -> tuple[str, memoryview]:
    """A fresh writable parcel of ``length`` bytes: its name and a view of its memory."""
    name = _name(owner_pid, tag)
    fd = os.open(_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, length)
        if length == 0:
            return name, memoryview(b"")
        return name, memoryview(mmap.mmap(fd, length))
    finally:
        os.close(fd)


def write(owner_pid: int, tag: str, data: memoryview) -> str:
    """A parcel holding a copy of ``data``."""
    name = _name(owner_pid, tag)
    fd = os.open(_DIR / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
    finally:
        os.close(fd)
    return name


def take(name: str) -> memoryview:
    """Map the parcel ``name`` read-only and remove its file (the mapping lives as long as the view)."""
    if "/" in name or not name.startswith(_PREFIX):
        raise ValueError(f"not a parcel name: {name!r}")
    path = _DIR / name
    fd = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
        size = os.fstat(fd).st_size
        return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ)) if size else memoryview(b"")
    finally:
        os.close(fd)


def sweep_dead() -> int:
    """Remove the parcels of ranks that no longer run (killed before they swept)."""
    n = 0
    owners = set()
    for path in _DIR.glob(_PREFIX + "*"):
        pid = path.name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit():
            owners.add(int(pid))
    for owner in owners:
        if not running(owner):
            n += sweep(owner)
    return n


def sweep(owner_pid: int) -> int:
    """Remove parcels of ``owner_pid``'s rank that nobody took (a worker or peer that died mid-way)."""
    n = 0
    for path in _DIR.glob(prefix(owner_pid) + "*"):
        try:
            path.unlink()
            n += 1
        except OSError:
            pass
    return n
