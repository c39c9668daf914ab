"""Outsiders without the secret cannot keep a job from starting: 200 connections that trickle a byte every 2 s
at the discovery store, alone and beside a flood of 2000 new connections a second at the store and at rank
0's transport port, from four addresses, while the ranks set up (``tests/attacker.py``, a process of its
own). The job's two ranks still join within their 30 s connect timeout, allreduce correctly, and their logs
hold a few lines about it instead of a line per refusal."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from erdma_core.cli.launcher import free_ports

HERE = Path(__file__).parent
RANK = """
import sys
import numpy as np
import erdma_core
pg = erdma_core.init()
x = np.arange(1000, dtype=np.float64) * (pg.rank() + 1)
pg.allreduce(x)
assert np.array_equal(x, np.arange(1000) * 3.0), x[:4]
print("allreduce ok", pg.rank(), flush=True)
pg.destroy()
"""


def _can_bind(address: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def _rank(rank: int, store: int, transport: int) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ERDMA_", "MASTER_"))}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store), "RANK": str(rank), "WORLD_SIZE": "2",
            "ERDMA_SECRET": "the job's own secret", "ERDMA_TRANSPORT_TCP_LOCAL_SOCKETS": "false",
            "ERDMA_TIMEOUTS_CONNECT": "30", "PYTHONUNBUFFERED": "1"}
    if rank == 0:
        env["ERDMA_TRANSPORT_TCP_PORT"] = str(transport)
    return subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


class _Lines:
    """The lines a process writes to its stdout, read by a thread of their own: ``wait(prefix, timeout)``."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(line) for line in proc.stdout or ()], daemon=True).start()

    def rest(self) -> str:
        """The last lines, those not waited for included."""
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen[-30:])

    def wait(self, prefix: str, timeout: float) -> str:
        """The next line that starts with ``prefix``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if line.startswith(prefix):
                return line
        pytest.fail(f"no line starting {prefix!r} within {timeout}s; got {''.join(self.seen[-20:])!r}")


@pytest.mark.skipif(not _can_bind("127.0.0.2"), reason="no 127.0.0.0/8 addresses to attack from")
@pytest.mark.parametrize("flood", [0, 2000])
def test_slow_connections_and_a_flood_do_not_keep_the_job_out(flood):
    store, transport = free_ports(2)
    attacker = subprocess.Popen(
        [sys.executable, str(HERE / "attacker.py"), "--slow-targets", f"127.0.0.1:{store}",
         "--flood-targets", f"127.0.0.1:{store},127.0.0.1:{transport}",
         "--sources", "127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5", "--slow", "200", "--flood", str(flood),
         "--seconds", "250"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks: list[subprocess.Popen[str]] = []
    try:
        ranks.append(_rank(0, store, transport))  # serves the store; its transport listens on `transport`
        said = _Lines(attacker)
        said.wait("slow 200", 120)  # the trickling connections are all open
        flooding = said.wait("open", 10)  # and the flood has run for a second: now the other rank starts
        ranks.append(_rank(1, store, transport))
        outs = [r.communicate(timeout=120) for r in ranks]
        assert attacker.poll() is None, f"the attack ended before the job did: {said.rest()}"
    finally:
        for p in [attacker, *ranks]:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert int(flooding.split()[3]) >= flood // 2, flooding  # the flood was under way before rank 1 started
    for rank, ((out, err), proc) in enumerate(zip(outs, ranks, strict=True)):
        assert proc.returncode == 0 and f"allreduce ok {rank}" in out, f"rank {rank}: {out}\n{err[-3000:]}"
        refused = [line for line in err.splitlines() if "refused" in line]
        assert len(refused) <= 30, f"rank {rank} logged {len(refused)} refusals:\n" + "\n".join(refused[:40])
    assert "refused" in outs[0][1], outs[0][1][-2000:]
