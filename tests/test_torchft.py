"""torchft on eRDMA (``erdma_core.torchft.ProcessGroupErdma``, ``examples/torchft_ddp.py``): a DDP job of two
replica groups against a real torchft Lighthouse survives one replica killed (SIGKILL) and started again.
Skipped where torchft does not install (``pip install torchft-nightly``)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft-nightly)")
ROOT = Path(__file__).resolve().parent.parent
STEPS = 150  # 15 s of steps: time for a killed replica to start again and rejoin on a busy host


class Replica:
    """One replica group's process; its stdout lines are read on a thread into ``lines``."""

    def __init__(self, replica_id: int, lighthouse: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ERDMA_", "MASTER_", "RANK", "WORLD_"))}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "torchft_ddp.py"), "--replica-id", str(replica_id),
             "--lighthouse", lighthouse, "--steps", str(STEPS), "--step-seconds", "0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr.append), daemon=True).start()

    @staticmethod
    def _read(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(line)
            m = re.fullmatch(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line {pattern!r} within {timeout}s; saw {self.seen[-5:]}; "
                             f"stderr: {''.join(self.stderr[-30:])[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def test_a_torchft_ddp_job_survives_a_killed_and_restarted_replica():
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    replicas = [Replica(0, lighthouse.address()), Replica(1, lighthouse.address())]
    try:
        for r in replicas:
            r.wait_for(r"step \d+ loss \S+ participants 2", 120)
        replicas[1].stop()  # SIGKILL mid-run
        # replica 0 goes on alone: its pending allreduce fails (the step is discarded), the quorum shrinks
        alone = int(replicas[0].wait_for(r"step (\d+) loss \S+ participants 1", 120).group(1))
        replicas[1] = Replica(1, lighthouse.address())
        back = replicas[1].wait_for(r"step (\d+) loss \S+ participants 2", 120)
        assert int(back.group(1)) > alone, "the restarted replica did not take the live step from its peer"
        done = [r.wait_for(r"done step (\d+) params (\w+)", 180) for r in replicas]
        assert [int(d.group(1)) for d in done] == [STEPS, STEPS]
        assert done[0].group(2) == done[1].group(2), "the replicas ended with different parameters"
    finally:
        for r in replicas:
            r.stop()
        lighthouse.shutdown()
