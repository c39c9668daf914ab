"""torch's abort on an "erdma" group (how torchft reconfigures): twelve groups made, used and aborted leave
the process with the threads and descriptors it had after the first; an op a peer waits on when a rank
aborts fails there at once, naming that rank (AbortedError, or PeerLostError where the closed connection
overtakes the ABORT frame). Prints one line: OK, or what went wrong."""

import os
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

dist.init_process_group("erdma")
rank, world = dist.get_rank(), dist.get_world_size()
problems: list[str] = []


def held() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


counts = []
for i in range(12):
    group = dist.new_group(backend="erdma")
    t = torch.full((1000,), float(rank + i))
    dist.all_reduce(t, group=group)
    if not torch.equal(t, torch.full((1000,), float(sum(range(world)) + world * i))):
        problems.append(f"round {i}: wrong sum {t[:3].tolist()}")
    dist.barrier()  # (on the default group) every rank has its result: an abort fails what is in flight
    _abort_process_group(group)
    counts.append(held())
if counts[-1] != counts[0]:
    problems.append(f"threads and descriptors after each abort: {counts}")

# rank 0 aborts while the others wait in an allreduce it never joins
group = dist.new_group(backend="erdma")
dist.barrier()
if rank == 0:
    _abort_process_group(group)
else:
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10), group=group)
        problems.append("an allreduce that rank 0 aborted returned")
    except Exception as exc:  # torch wraps the eRDMA error's text
        took = time.monotonic() - start
        # the ABORT frame, or (when rank 0's close overtakes it on the wire) the lost connection to rank 0
        text = f"{type(exc).__name__}: {exc}"
        told = "AbortedError" in text and "rank 0 aborted the job" in text
        lost = "PeerLostError" in text and "lost rank 0" in text
        if not (told or lost) or took > 10:
            problems.append(f"after {took:.1f}s: {type(exc).__name__}: {exc}")
    _abort_process_group(group)
dist.barrier()
dist.destroy_process_group()
print(("OK" if not problems else "; ".join(problems)), flush=True)
