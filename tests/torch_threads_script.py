"""Which thread runs a collective issued through torch.distributed: ``dist.all_reduce(t)`` (torch says its
caller waits at once: ``opts.asyncOp`` False) runs on the caller's thread; ``async_op=True`` on the group's
runners while nobody waits. Prints one line: OK, or what ran where."""

import threading
import time

import torch
import torch.distributed as dist

import erdma_core.engine.executor as pg_mod
import erdma_core.torch  # noqa: F401

dist.init_process_group("erdma")
seen: list[str] = []
orig = pg_mod.run


def spy(*args, **kw):
    seen.append(threading.current_thread().name)
    return orig(*args, **kw)


pg_mod.run = spy
t = torch.ones(100)
dist.all_reduce(t)
dist.broadcast(t, 0)
dist.all_gather_into_tensor(torch.empty(100 * dist.get_world_size()), t)
dist.barrier()
sync = list(seen)
seen.clear()
work = dist.all_reduce(t, async_op=True)
deadline = time.monotonic() + 30
while not work.is_completed() and time.monotonic() < deadline:
    time.sleep(0.001)
asynchronous = list(seen)
w = dist.get_world_size()
me = threading.current_thread().name
ok = (sync == [me] * 4 and len(asynchronous) == 1 and asynchronous[0].startswith("erdma-pg")
      and bool((t == w * w).all()))
print("OK" if ok else f"WRONG sync={sync} async={asynchronous} t={t[:3]}", flush=True)
dist.destroy_process_group()
