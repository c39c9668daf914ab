"""A torch subgroup's timeout with one rank absent: every other rank's error names the group as torch does
(its name and description, not eRDMA's "group 0") and rank 1, which never called the allreduce. Prints one
line: OK, or the error."""

import datetime
import time

import torch
import torch.distributed as dist

dist.init_process_group("erdma")
rank = dist.get_rank()
group = dist.new_group(backend="erdma", timeout=datetime.timedelta(seconds=2), group_desc="tp")
dist.all_reduce(torch.ones(4), group=group)  # the group works
result = "OK"
if rank == 1:
    time.sleep(8)
else:
    try:
        dist.all_reduce(torch.ones(1 << 16), group=group)
        result = "an allreduce without rank 1 returned"
    except Exception as exc:  # torch wraps the eRDMA error's text
        name = dist.distributed_c10d._get_process_group_name(group)
        if f"(group {name} (tp), seq " not in str(exc) or "rank 1 has not called it" not in str(exc):
            result = f"{type(exc).__name__}: {exc}"
print(result, flush=True)
dist.destroy_process_group(group)
dist.destroy_process_group()
