"""Rank 1 is killed (SIGKILL) after DDP's first step; rank 0's next backward must raise an error that names
rank 1 and the op, with none of eRDMA's frames in it. Prints the error, its type first, between markers."""

import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("erdma")
model = DDP(torch.nn.Linear(256, 256))
for step in range(5):
    if step == 1 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        model(torch.ones(8, 256)).sum().backward()
    except Exception as exc:
        print(f"<<<{type(exc).__name__}: {exc}>>>", flush=True)
        break
else:
    print("no error")
