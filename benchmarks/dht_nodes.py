"""A few real DHT server nodes (``erdma dht serve``, erdma-p2p) on loopback, as processes that a benchmark kills
and starts again, as ``erdma_core.testing.etcd.EtcdCluster`` does with etcd members: the bootstrap nodes of a
``dht://`` elastic job."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

READY_S = 20.0


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DhtNodes:
    def __init__(self, n: int, folder: Path) -> None:
        self.folder = folder
        self.ports = [_free_udp_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        try:
            for i in range(n):
                self.start(i)
        except BaseException:
            self.close()
            raise

    def url(self, job: str) -> str:
        return "dht://" + ",".join(f"127.0.0.1:{p}" for p in self.ports) + f"/{job}"

    def addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.ports]

    def start(self, i: int) -> None:
        """Start node ``i`` on its port, joining through the others that run (the first alone: none)."""
        others = ",".join(f"127.0.0.1:{p}" for k, p in enumerate(self.ports) if k != i and self.alive(k))
        path = self.folder / f"dht{i}.log"
        before = path.read_bytes().count(b"serving on") if path.exists() else 0
        log = open(path, "ab")  # (the process holds it)
        cmd = [sys.executable, "-m", "erdma_core.cli", "dht", "serve", "--bind", "127.0.0.1",
               "--port", str(self.ports[i]), *(["--bootstrap", others] if others else [])]
        self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        end = time.monotonic() + READY_S
        while path.read_bytes().count(b"serving on") == before:
            proc = self.procs[i]
            assert proc is not None
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"DHT node {i} did not start: {path.read_text()[-400:]}")
            time.sleep(0.05)

    def alive(self, i: int) -> bool:
        proc = self.procs[i]
        return proc is not None and proc.poll() is None

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)

    def __enter__(self) -> DhtNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
