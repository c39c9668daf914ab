"""Rank 1 vanishes after joining; rank 0's next all_reduce must raise, naming rank 1 and the op."""

import os

import torch
import torch.distributed as dist

import erdma_core.torch  # noqa: F401

dist.init_process_group("cpu:erdma,cuda:erdma")
t = torch.ones(1 << 20)
dist.all_reduce(t)
if dist.get_rank() == 1:
    os._exit(0)
try:
    for _ in range(3):
        dist.all_reduce(t)
    print("no error")
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
