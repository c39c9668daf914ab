"""DPDK's environment abstraction layer, once per process: started on first use without hugepages or PCI
(``--no-huge --single-file-segments -m N --no-pci``, a file prefix of its own so that every rank is an
independent primary), and left to the process's exit. Its run-time folder is removed as soon as the EAL has
started (the files in it are mapped; only a secondary process would open them, and erdma starts none), so that
a killed rank leaves nothing behind there; run-time folders of older processes that are gone, and memif
sockets of killed ranks, are removed by the next rank that starts on the host.

``rte_eal_cleanup`` is not called. In DPDK 22.11 it frees the EAL's memory while the interrupt thread keeps
running, and memif removes its socket callbacks lazily, on that thread, at the socket's next event: a rank
whose peer closed its memif connection after cleanup died of SIGSEGV in ``rte_intr_fd_get`` on that thread at
exit (seen after a 16 MiB ``erdma bench`` on 2 ranks, every time). With ports closed and pools freed at
close, no hugepages and the run-time folder gone, what the EAL still holds is this process's memory and file
descriptors, which its exit returns."""

from __future__ import annotations

import atexit
import logging
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Callable

from erdma_core.sdk import ErdmaError
from erdma_core.toolkit import running

from ._shim import ffi, lib

log = logging.getLogger("erdma.dpdk")
PREFIX = "erdma-"
_lock = threading.Lock()
_started: dict[str, int] = {}  # pid, memory_mb
_closers: list[Callable[[], None]] = []  # open endpoints, closed before the EAL at exit


class DpdkError(ErdmaError):
    """DPDK refused (EAL start-up, a device, a pool)."""


def error() -> str:
    return ffi.string(lib.eds_error()).decode(errors="replace")


def runtime_root() -> pathlib.Path:
    """Where DPDK keeps its run-time folders (rte_eal's rule)."""
    if os.geteuid() == 0:
        return pathlib.Path("/var/run/dpdk")
    return pathlib.Path(os.environ.get("XDG_RUNTIME_DIR", "/tmp")) / "dpdk"


def sweep(root: pathlib.Path, pattern: str, pid_of: Callable[[str], int | None]) -> int:
    """Remove what ``pattern`` matches under ``root`` whose owning process (``pid_of(name)``) is gone."""
    removed = 0
    for path in root.glob(pattern) if root.exists() else []:
        pid = pid_of(path.name)
        if pid is None or pid == os.getpid() or running(pid):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed += 1
    return removed


def sweep_sockets(run_dir: pathlib.Path) -> int:
    """memif sockets under ``run_dir`` (a folder per job) whose ranks are gone, then job folders left empty for a
    minute (a younger empty one may be a starting job's, whose ranks are about to make their sockets)."""
    removed = 0
    for job in run_dir.iterdir() if run_dir.is_dir() else []:
        if not job.is_dir():
            continue
        removed += sweep(job, "memif-*.sock", socket_pid)
        try:
            if time.time() - job.stat().st_mtime > 60:
                job.rmdir()
        except OSError:  # live ranks' sockets are there, or another rank removed it first
            pass
    return removed


def socket_pid(name: str) -> int | None:
    """``memif-0-1.1234.sock``: 1234."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def _pid_in(name: str) -> int | None:
    """``erdma-1234``: 1234."""
    tail = name[len(PREFIX):]
    return int(tail) if name.startswith(PREFIX) and tail.isdigit() else None


def start(memory_mb: int) -> None:
    """Start the EAL in this process (once)."""
    with _lock:
        if _started:
            if _started["pid"] != os.getpid():
                raise DpdkError("DPDK was started in the parent of this process before it forked; DPDK cannot be "
                                "used in a forked child of a process that started it (start it in each child)")
            return
        root = runtime_root()
        gone = sweep(root, PREFIX + "*", _pid_in)
        if gone:
            log.info("removed %d DPDK run-time folder(s) of processes that no longer exist", gone)
        _check_room(root, memory_mb)
        prefix = f"{PREFIX}{os.getpid()}"
        core = min(os.sched_getaffinity(0))
        # --single-file-segments: the EAL's memory is one shared file (a memfd without hugepages), which memif's
        # zero-copy client lends to its peer (``backends.memif_args``)
        args = ["erdma-dpdk", "--no-huge", "--single-file-segments", "-m", str(memory_mb), "--no-pci",
                "--no-telemetry", f"--file-prefix={prefix}", "-l", str(core), "--log-level=*:warning"]
        keep = [ffi.new("char[]", a.encode()) for a in args]
        argv = ffi.new("char *[]", [*keep, ffi.NULL])
        if lib.eds_eal_init(len(args), argv) != 0:
            raise DpdkError(f"DPDK did not start ({' '.join(args[1:])}): {error()}")
        # its files are mapped already, and only a secondary process would open them again (erdma starts none):
        # gone now, nothing is left behind even by a rank that is killed
        shutil.rmtree(root / prefix, ignore_errors=True)
        _started.update(pid=os.getpid(), memory_mb=memory_mb)
        atexit.register(_at_exit)
        log.info("DPDK started: %s", " ".join(args[1:]))


def _check_room(root: pathlib.Path, memory_mb: int) -> None:
    """The EAL maps files in its run-time folder (its page table: about 12 KiB per MB of ``-m`` without
    hugepages); where they cannot grow, it dies of SIGBUS with no message. So refuse, naming the folder, when it
    has less than twice that free."""
    need = (1 << 20) + memory_mb * (12 << 10)
    try:
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
    except OSError as exc:
        raise DpdkError(f"DPDK's run-time folder {root} cannot be used: {exc}") from None
    if free < 2 * need:
        raise DpdkError(f"DPDK's run-time folder {root} has {free / 2**20:.1f} MiB free; the EAL maps about "
                        f"{need / 2**20:.1f} MiB of files there for -m {memory_mb} (transport.dpdk.eal_memory_mb), "
                        "and dies of SIGBUS when they cannot grow: free space there"
                        + ("" if os.geteuid() == 0 else " (or point XDG_RUNTIME_DIR at a folder with room)"))


def lend_memory() -> bool:
    """True once per process: the first memif client port may run in zero-copy mode, no other. DPDK 22.11's
    memif takes the EAL's own descriptor of its memory file (``rte_memseg_get_fd``, not a duplicate) for a
    zero-copy client and closes it once connected; a second zero-copy port in the process, in this process group
    or a later one, would send the peer whatever file has that number by then, and close it."""
    with _lock:
        if _started.get("lent") == os.getpid():
            return False
        _started["lent"] = os.getpid()
        return True


def memory_mb() -> int:
    return _started.get("memory_mb", 0)


def on_exit(close: Callable[[], None]) -> Callable[[], None]:
    """Run ``close`` at exit (a process group not destroyed); returns a function that forgets it."""
    _closers.append(close)
    return lambda: _closers.remove(close) if close in _closers else None


def _at_exit() -> None:
    if _started.get("pid") != os.getpid():
        return
    for close in list(reversed(_closers)):
        try:
            close()
        except Exception:  # exiting: the others still close
            log.debug("closing a DPDK endpoint at exit failed", exc_info=True)
