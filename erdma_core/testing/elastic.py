"""A test harness for elastic jobs: a store served here and peers started, killed and read as processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..cli.launcher import free_port
from ..discovery.store import TCPStore


def _clock(t: float) -> str:
    return f"{time.strftime('%H:%M:%S', time.localtime(t))}.{int(t * 1000) % 1000:03d}"


class Peer:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc, self.log = proc, log
        self.started = time.time()
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line came (time.monotonic())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log, "w") as f:  # the log file says when the peer started and when each line came
            f.write(f"{_clock(self.started)} started, pid {self.proc.pid}\n")
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace")
                f.write(f"{_clock(time.time())} {line}")
                f.flush()
                self.times.append(time.monotonic())
                self.lines.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5.0)
        return code


class ElasticJob:
    """One elastic job: its store (served by this process, as `erdma run --elastic` does, or ``store_url``,
    e.g. an etcd cluster's) and its peers, each ``cmd`` with the job's environment (set-up and collective
    timeouts of 20 s and 60 s unless ``env`` says otherwise), output in ``folder``."""

    def __init__(self, cmd: Sequence[str], folder: Path, *, min_peers: int, secret: str = "elastic-test",
                 env: dict[str, str] | None = None, host: str = "127.0.0.1", store_url: str | None = None) -> None:
        self.cmd, self.folder = list(cmd), Path(folder)
        self.store: TCPStore | None = None
        if store_url is None:
            self.port = free_port()
            self.store = TCPStore(host, self.port, is_server=True, timeout=10.0, secret=secret.encode())
            where = {"MASTER_ADDR": host, "MASTER_PORT": str(self.port)}
        else:
            where = {"ERDMA_INIT_METHOD": store_url}
        self.env = {**os.environ, **where, "ERDMA_SECRET": secret,
                    "ERDMA_ELASTIC_MIN_PEERS": str(min_peers), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    "ERDMA_TIMEOUTS_CONNECT": "20", "ERDMA_TIMEOUTS_COLLECTIVE": "60", **(env or {})}
        self.peers: list[Peer] = []

    def start(self, extra_env: dict[str, str] | None = None, wrap: Sequence[str] = ()) -> Peer:
        """Start a peer (``wrap``: a command that runs it, e.g. ``ip netns exec NS``)."""
        log = self.folder / f"peer{len(self.peers)}.log"
        proc = subprocess.Popen([*wrap, *self.cmd], env={**self.env, **(extra_env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        peer = Peer(proc, log)
        self.peers.append(peer)
        return peer

    def live(self) -> list[Peer]:
        return [p for p in self.peers if p.alive()]

    def wait_all(self, timeout: float) -> list[int | None]:
        """Every peer's exit code; a peer still running at the deadline is killed and reads None."""
        end = time.monotonic() + timeout
        codes: list[int | None] = []
        for p in self.peers:
            try:
                codes.append(p.wait(max(0.1, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(None)
        return codes

    def close(self) -> None:
        for p in self.peers:
            p.kill()
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def python(*args: str | Path) -> list[str]:
    return [sys.executable, *map(str, args)]


def steps(peer: Peer) -> list[str]:
    """The lines of an ``elastic_peer`` that report a step."""
    return [line for line in peer.lines if line.startswith("step ")]


def ask_where(*launchers: subprocess.Popen[Any]) -> None:
    """Each launcher's child processes print their threads' stacks (``elastic_peer`` registers SIGUSR1), which
    the launcher copies to its output; waits 2 s for that."""
    for launcher in launchers:
        kids = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGUSR1)
    time.sleep(2.0)


def until(done: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.02)


def stopped_peer_counted_out(job: ElasticJob) -> float:
    """Three ``elastic_peer`` s of ``job`` (min_peers 3, STOP_FILE in its env); one SIGSTOPped after its third
    step with all three in the job (under load the founding may leave a slow starter out, to be admitted
    later: stopping one of two would leave the other without a quorum). Returns the seconds from the SIGSTOP
    until the other two completed a step without it; then the stopped one runs again (and rejoins) and all
    stop. Asserts they exit 0."""
    a, b, c = job.start(), job.start(), job.start()
    until(lambda: sum(" n 3 " in line for line in steps(c)) >= 3, "3 steps of the three together")
    os.kill(c.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    before = len(steps(a))
    until(lambda: any(" n 2 " in line for line in steps(a)[before:]), "a step without the stopped peer")
    took = time.monotonic() - stopped
    os.kill(c.pid, signal.SIGCONT)
    seen = len(steps(c))
    until(lambda: len(steps(c)) >= seen + 2, "the stopped peer back")
    Path(job.env["STOP_FILE"]).touch()
    codes = [p.wait(60) for p in (a, b, c)]
    assert codes == [0, 0, 0], (codes, c.lines[-5:])
    return took
