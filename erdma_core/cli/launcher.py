"""``erdma run``: start N local ranks with the env:// variables torchrun sets, and a secret for the job
(``ERDMA_SECRET``, unless one is set); one failing rank ends all. SIGTERM, SIGINT or SIGHUP to the launcher
stops its ranks (``stops_on_signals``), and it then ends as that signal would have ended it."""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, NoReturn

MAX_RANKS = 256  # processes `erdma run -n` starts on one host unless --max-ranks says more
GRACE_S = 5.0
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Signalled(BaseException):
    """The launcher got one of ``STOPPING``: what it started is stopped on the way out (``except`` and
    ``finally`` blocks), then ``erdma`` ends as the signal would have ended it (``die_of``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopping:
    """The first of ``STOPPING`` that arrived inside ``stops_on_signals``. The handler only notes it: an
    exception raised from a handler lands between any two bytecodes of the main thread, for example between
    ``Popen.poll``'s taking of its wait lock and the ``try`` that gives it back, and every later ``wait`` on
    that process then blocks for ever. The launcher's loops call ``check`` where a raise is safe."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def check(self) -> None:
        """Raise ``Signalled`` if a signal arrived."""
        if self.signum is not None:
            raise Signalled(self.signum)


@contextlib.contextmanager
def stops_on_signals() -> Iterator[Stopping]:
    """While inside, the first SIGTERM, SIGINT or SIGHUP is noted in the ``Stopping`` yielded (its ``check``
    then raises ``Signalled``); later ones are ignored until the block is left, so the clean-up inside it is
    not cut short. Elsewhere than in the main thread (where Python takes signals), nothing is noted."""
    stopping = Stopping()
    if threading.current_thread() is not threading.main_thread():
        yield stopping
        return

    def handler(signum: int, frame: object) -> None:
        if stopping.signum is None:
            stopping.signum = signum

    old = {s: signal.signal(s, handler) for s in STOPPING}
    try:
        yield stopping
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def die_of(signum: int) -> NoReturn:
    """End this process as ``signum``'s default action does, so whoever waits for it sees that signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default action is not to end the process: the shell's convention


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different free TCP ports on loopback: each is held until all are picked (one at a time, the
    kernel may hand out a port it just gave back)."""
    held = [socket.socket() for _ in range(count)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


_OUTPUT_LOCK = threading.Lock()


def _pump(src: IO[bytes], dst: IO[str], prefix: str) -> None:
    """Copy a rank's output as it comes, a whole line at a time (a progress line ends in \r, not \n),
    each prefixed, so that ranks never interleave inside a line."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    while True:
        chunk = os.read(src.fileno(), 65536)
        pending += decoder.decode(chunk, final=not chunk)
        lines = re.split(r"(?<=[\r\n])", pending)
        pending = lines.pop() if chunk else ""  # keep an unfinished line until its end arrives
        lines = [line for line in lines if line]
        if lines:
            with _OUTPUT_LOCK:
                dst.write("".join(line if line in ("\r", "\n") else prefix + line for line in lines))
                dst.flush()
        if not chunk:
            return


def unstartable(program: str) -> str | None:
    """Why ``program`` cannot be started (not found on PATH, not there, not executable), or None."""
    if os.sep not in program:
        return None if shutil.which(program) else "not found on PATH"
    if not os.path.exists(program):
        return "No such file or directory"
    if os.path.isdir(program) or not os.access(program, os.X_OK):
        return "not an executable file"
    return None


def local_env(env: Mapping[str, str], nprocs: int, config: str | None) -> dict[str, str]:
    """What every process this launcher starts on this host gets, on top of ``env``: unbuffered output, the
    config file, and a share of the cores for its intra-op threads."""
    out = {"PYTHONUNBUFFERED": "1"}
    if config:
        out["ERDMA_CONFIG"] = os.path.abspath(config)
    if nprocs > 1 and "OMP_NUM_THREADS" not in env:
        # as torchrun does: N ranks each running a full-width intra-op pool oversubscribe the cores
        out["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nprocs))
    return out


def run(nprocs: int, cmd: Sequence[str], *, config: str | None = None, env: Mapping[str, str] | None = None,
        master_addr: str = "127.0.0.1", prefix: bool = True, timeout: float | None = None) -> int:
    """Run ``cmd`` as ranks 0..nprocs-1; return 0, or the exit code of the first rank that failed."""
    if nprocs < 1:
        raise ValueError(f"-n must be at least 1, got {nprocs}")
    base = {**os.environ, **(env or {}), "MASTER_ADDR": master_addr, "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs)}
    base |= local_env(base, nprocs, config)
    if not base.get("ERDMA_SECRET") and not base.get("ERDMA_SECURITY_SECRET"):
        # a secret per job, known only to its ranks: every connection they accept must prove it (a secret
        # set in the config file is overridden: the ranks are all started here, with this one)
        base["ERDMA_SECRET"] = secrets.token_hex(32)
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    with stops_on_signals() as stopping:
        try:
            for rank in range(nprocs):
                stopping.check()
                try:
                    p, threads = spawn(list(cmd), {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                       f"[rank {rank}] " if prefix else None)
                except OSError as exc:  # (unstartable() said it could be: it went, or the host is out of processes)
                    stop(procs)
                    sys.stderr.write(f"erdma run: cannot start rank {rank} ({cmd[0]!r}): {exc.strerror or exc}; "
                                     "stopped the other ranks\n")
                    return 127
                procs.append(p)
                pumps += threads
            failed = _wait(procs, timeout, stopping)
        except Signalled as sig:
            stop(procs)
            for t in pumps:
                t.join(2.0)
            sys.stderr.write(f"erdma run: got {sig}; stopped the ranks\n")
            raise
        if failed is not None:
            stop(procs)
    for t in pumps:
        t.join(2.0)
    if failed is None:
        return 0
    rank, code = failed
    who = "the run timed out" if code == 124 and rank < 0 else f"rank {rank} exited with code {code}"
    sys.stderr.write(f"erdma run: {who}; stopped the other ranks\n")
    return code if code > 0 else 128 - code


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float | None, stopping: Stopping
          ) -> tuple[int, int] | None:
    """Until every rank ended well (None), one failed (its rank and code) or ``timeout`` passed (-1, 124);
    ``Signalled`` once ``stopping`` noted a signal."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.01
    while True:
        stopping.check()
        codes = [p.poll() for p in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            return bad[0]
        if all(c == 0 for c in codes):
            return None
        if deadline is not None and time.monotonic() > deadline:
            return (-1, 124)
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)


def spawn(cmd: list[str], env: Mapping[str, str], prefix: str | None
          ) -> tuple[subprocess.Popen[bytes], list[threading.Thread]]:
    """Start ``cmd`` in a session of its own; with ``prefix``, its output lines are copied with it."""
    pipe = subprocess.PIPE if prefix is not None else None
    p = subprocess.Popen(cmd, env=dict(env), stdout=pipe, stderr=pipe, start_new_session=True)
    threads = []
    if prefix is not None:
        for src, dst in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(src, dst, prefix), daemon=True)
            t.start()
            threads.append(t)
    return p, threads


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each process's group (its session), SIGKILL to those still there ``GRACE_S`` later."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(p.pid, signum)
    except ProcessLookupError:  # it ended meanwhile
        pass
