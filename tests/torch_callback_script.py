"""A collective issued and waited for inside another's future callback, as DDP's PowerSGD hook does
(issue: it deadlocked under erdma, which ran the callback on its single collective thread); then the same
while a third collective, issued before the callback runs, waits in the queue ahead of the callback's (it
deadlocked too: the callback held the only thread that could run the queue)."""

import os
import sys

import torch
import torch.distributed as dist

backend = sys.argv[1]
if backend == "erdma":
    import erdma_core.torch  # noqa: F401
dist.init_process_group(backend)
t, t2 = torch.ones(1000), torch.full((1000,), 2.0)
fut = dist.all_reduce(t, async_op=True).get_future().then(
    lambda f: dist.all_reduce(t2, async_op=True).get_future().wait())
fut.wait()
w = dist.get_world_size()
ok = bool((t == w).all() and (t2 == 2 * w).all())
big, t3, t4 = torch.ones(1 << 20), torch.full((10,), 3.0), torch.full((10,), 4.0)
first = dist.all_reduce(big, async_op=True)
third = dist.all_reduce(t3, async_op=True)  # queued behind the first, ahead of the callback's
# the callback is attached after t3 is issued: attached before, it could run (when big was quick) before t3
# on one rank and after it on the other, and t3 and t4 would meet each other (CI saw "WRONG" once)
fut = first.get_future().then(lambda f: dist.all_reduce(t4, async_op=True).get_future().wait())
fut.wait()
third.wait()
ok = ok and bool((big == w).all() and (t3 == 3 * w).all() and (t4 == 4 * w).all())
print(f"rank {os.environ['RANK']} callback {'OK' if ok else 'WRONG'}")
dist.destroy_process_group()
