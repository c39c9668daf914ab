"""A real etcd cluster for tests and benchmarks: ``n`` members of Debian's ``etcd`` on loopback ports, their data
in memory (/dev/shm: a member's fsync costs nothing there), each one killed, restarted or asked who leads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..cli.launcher import free_port


def missing() -> str | None:
    """Why no cluster can start here (None: it can)."""
    if shutil.which("etcd") is None:
        return "etcd is not installed (scripts/system-deps.sh test installs Debian's etcd-server)"
    return None


class EtcdCluster:
    """``n`` members started together (``url(prefix)`` names them all); ``kill(i)`` (SIGKILL), ``start(i)``
    (again, on its data), ``stop(i)``/``cont(i)`` (SIGSTOP/SIGCONT), ``leader()``. Members log to
    ``folder``."""

    def __init__(self, n: int = 3, folder: Path | None = None, *, ready_s: float = 60.0) -> None:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.data = Path(tempfile.mkdtemp(prefix="erdma-etcd-", dir=shm))
        self.folder = Path(folder) if folder is not None else self.data
        self.client = [free_port() for _ in range(n)]
        self.peer = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self._initial = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(self.peer))
        try:
            for i in range(n):
                self.start(i)
            self.wait_ready(ready_s)
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client]

    def order(self, first: int = 0) -> list[int]:
        """The members from ``first`` on, in a ring."""
        n = len(self.procs)
        return [(first + k) % n for k in range(n)]

    def url(self, prefix: str, first: int = 0) -> str:
        """The cluster's URL for a job under ``prefix``, member ``first`` first (a client tries it first)."""
        return f"etcd://{','.join(self.endpoints[i] for i in self.order(first))}/{prefix}"

    def start(self, i: int) -> None:
        c, p = f"http://127.0.0.1:{self.client[i]}", f"http://127.0.0.1:{self.peer[i]}"
        log = open(self.folder / f"etcd-m{i}.log", "ab")
        self.procs[i] = subprocess.Popen(
            ["etcd", "--name", f"m{i}", "--data-dir", str(self.data / f"m{i}"), "--listen-client-urls", c,
             "--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
             "--initial-cluster", self._initial, "--initial-cluster-state", "new",
             "--initial-cluster-token", self.data.name, "--logger", "zap", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def stop(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)

    def cont(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        os.kill(proc.pid, signal.SIGCONT)

    def alive(self, i: int) -> bool:
        proc = self.procs[i]
        return proc is not None and proc.poll() is None

    def status(self, i: int, timeout: float = 2.0) -> dict[str, Any] | None:
        """Member ``i``'s own view (``/v3/maintenance/status``), or None when it does not answer."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.client[i]}/v3/maintenance/status", data=b"{}",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())  # type: ignore[no-any-return]
        except (OSError, ValueError, urllib.error.URLError):
            return None

    def leader(self, timeout: float = 30.0) -> int:
        """The index of the member that leads now (waiting up to ``timeout`` for a leader)."""
        end = time.monotonic() + timeout
        while True:
            ids: dict[str, int] = {}
            lead = None
            for i in range(len(self.procs)):
                st = self.status(i) if self.alive(i) else None
                if st is not None:
                    ids[str(st["header"]["member_id"])] = i
                    lead = str(st.get("leader", "0"))
            if lead in ids:
                return ids[lead]
            if time.monotonic() > end:
                raise TimeoutError(f"no etcd member leads after {timeout:.0f}s (logs in {self.folder})")
            time.sleep(0.1)

    def wait_ready(self, timeout: float) -> None:
        """Until a write commits (a leader, a majority)."""
        end = time.monotonic() + timeout
        body = json.dumps({"key": "cmVhZHk=", "value": "MQ=="}).encode()  # "ready" = "1"
        while True:
            for port in self.client:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v3/kv/put", data=body,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=2.0) as resp:
                        if "error" not in json.loads(resp.read()):
                            return
                except (OSError, ValueError, urllib.error.URLError):
                    pass
            if time.monotonic() > end:
                raise TimeoutError(f"the etcd cluster took no write within {timeout:.0f}s (logs in {self.folder})")
            time.sleep(0.1)

    def close(self) -> None:
        for i in range(len(self.procs)):
            proc = self.procs[i]
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
            self.kill(i)
        shutil.rmtree(self.data, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
