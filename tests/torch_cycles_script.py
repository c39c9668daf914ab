"""One rank of tests/test_torch_cycles.py: N groups made and given back through torch.distributed, every one on
the same port (tcp://127.0.0.1:PORT, rank 0 serving torch's store there), each checked with an allreduce and
then destroyed (``destroy_process_group``) or aborted (``_abort_process_group``).

    python torch_cycles_script.py BACKEND CYCLES destroy|abort SYNC_DIR   (RANK, PORT in the environment)

The ranks meet in SYNC_DIR after each cycle, so that the next group starts only once both gave the last one
back. Prints one JSON line: after each cycle, this process's Python threads, OS threads and open descriptors
(OS threads counted once those that were told to end have: at most 2 s; ``counts``)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist


def counts(settle_to: int | None) -> tuple[int, int, int]:
    """The counts once the OS threads are down to ``settle_to``; for the first cycle (None), once their number
    has not changed for 0.5 s (a thread the first group told to end may still be on its way out: under load
    one was, and the first row read one thread more than every later one). Either way at most 2 s."""
    end = time.monotonic() + 2.0
    last, since = -1, time.monotonic()
    while True:
        tasks = len(os.listdir("/proc/self/task"))
        if tasks != last:
            last, since = tasks, time.monotonic()
        settled = time.monotonic() - since >= 0.5 if settle_to is None else tasks <= settle_to
        if settled or time.monotonic() > end:
            return threading.active_count(), tasks, len(os.listdir("/proc/self/fd"))
        time.sleep(0.01)


def main() -> None:
    backend, cycles, mode, sync = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    rank = int(os.environ["RANK"])
    rows: list[tuple[int, int, int]] = []
    for i in range(cycles):
        dist.init_process_group(backend, rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{os.environ['PORT']}")
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t)
        assert t.tolist() == [3.0] * 4, t
        if mode == "abort":
            dist.barrier()  # (an abort fails the peer's op in flight: none is)
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
        (sync / f"{i}.{rank}").touch()
        given_up = time.monotonic() + 120  # (the other rank failed: its error is the test's to show)
        while not (sync / f"{i}.{1 - rank}").exists():
            if time.monotonic() > given_up:
                raise SystemExit(f"rank {rank}: the other rank did not finish cycle {i} within 120 s")
            time.sleep(0.005)
        rows.append(counts(rows[0][1] if rows else None))
    print(json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
