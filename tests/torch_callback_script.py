"""A collective issued and waited for inside another's future callback, as DDP's PowerSGD hook does
(issue: it deadlocked under erdma, which ran the callback on its single collective thread)."""

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
print(f"rank {os.environ['RANK']} callback {'OK' if ok else 'WRONG'}")
dist.destroy_process_group()
