"""``python -m erdma_core.testing.elastic_peer``: a peer of the elastic kill tests and benchmarks.

Each step allreduces (average) a vector of ``ELEMENTS`` float32 holding one value per peer, adds it to the state
and prints the step, the count, the result's first element, whether the result is one value throughout, the
state hash, how long the allreduce took and whether it ran again. The members stop together once ``STOP_FILE``
exists on one of them (a MAX allreduce of a flag each step), or after ``STEPS`` steps, and then finish the job:
a peer still waiting to be admitted is told so, prints ``job finished`` and exits 0. ``DIE_IN=k``: this peer
kills itself (SIGKILL) in the middle of its k-th allreduce of the vector, before one of that allreduce's
messages picked at random (the first allreduce counts how many there are). A ``sync`` that changed the
membership prints how long it took. ``SHOW_RING=1``: each step's line ends with the ring order the vector's
allreduce started in (``ring 0,1,2,3``) and this peer's rank. ``COMPUTE_S=s``: each step sleeps ``s`` seconds
before the vector's allreduce (a step's local work) and its line ends with the epoch whose group was up when
that work ended (``came_in E``). SIGUSR1 prints every thread's stack to stderr (a test asks a silent peer
where it is).
"""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import sys
import time
from typing import Any

import numpy as np

from erdma_core import elastic


class Killer:
    """Counts the messages this peer sends through a transport; SIGKILL before the ``kill_at``-th."""

    def __init__(self, transport: Any, kill_at: int) -> None:
        self.transport, self.kill_at, self.sent = transport, kill_at, 0
        self.send = transport.isend
        transport.isend = self.isend

    def isend(self, *args: Any) -> Any:
        self.sent += 1
        if self.sent == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.send(*args)

    def restore(self) -> int:
        self.transport.isend = self.send
        return self.sent


def main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    n_elements = int(os.environ.get("ELEMENTS", str(1 << 22)))
    steps = int(os.environ.get("STEPS", "20"))
    die_in = int(os.environ.get("DIE_IN", "0"))
    stop_file = os.environ.get("STOP_FILE", "")
    show_ring = os.environ.get("SHOW_RING") == "1"
    compute_s = float(os.environ.get("COMPUTE_S", "0"))
    state = {"w": np.zeros(n_elements, np.float32)}
    try:
        group = elastic.join(state)
    except elastic.JobFinishedError:
        print("job finished", flush=True)
        return 0
    mine = float(os.getpid() % 97 + 1)
    taken, frames = 0, 0
    try:
        while group.step < steps:
            t0, epoch = time.monotonic(), group.epoch
            group.sync()
            if group.epoch != epoch:
                print(f"sync took {time.monotonic() - t0:.4f} epoch {group.epoch} members {group.size()} "
                      f"setup {group.setup_s:.4f}", flush=True)
            flag = np.array([os.path.exists(stop_file) if stop_file else 0], np.int32)
            if group.allreduce(flag, op="max") == 0:
                continue
            if flag[0]:
                break
            x = np.full(n_elements, mine, np.float32)
            taken += 1
            if compute_s:
                time.sleep(compute_s)
            assert group.pg is not None  # (waits for an epoch the members form meanwhile)
            came_in = group.epoch
            ring = ",".join(map(str, group.pg.ring)) if show_ring else ""  # (the order this allreduce starts in)
            kill_at = random.randint(1, frames) if taken == die_in and frames else 0
            killer = Killer(group.pg.transport, kill_at) if taken <= die_in else None
            t0, aborted = time.monotonic(), group.counters["aborted"]
            n = group.allreduce(x)
            took = time.monotonic() - t0
            if killer is not None:
                frames = killer.restore()
            if kill_at:  # it sent fewer messages this time (the first one ran again, with more): die now
                print("late kill", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if n == 0:
                continue
            state["w"] += x
            group.step += 1
            uniform = bool((x == x[0]).all())
            print(f"step {group.step} n {n} value {x[0]!r} uniform {uniform} epoch {group.epoch} "
                  f"hash {group.state_hash()[:16]} took {took:.4f} retried {group.counters['aborted'] - aborted} "
                  f"setup {group.setup_s:.4f}" + (f" ring {ring} rank {group.rank()}" if show_ring else "")
                  + (f" came_in {came_in}" if compute_s else ""), flush=True)
    except elastic.JobFinishedError as exc:  # the others finished while this member waited on its last step
        print(f"job finished: {exc}", flush=True)
        return 0
    print(f"counters {' '.join(f'{k}={v}' for k, v in group.counters.items())}", flush=True)
    group.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
