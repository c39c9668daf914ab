"""Train a small MLP with DDP to fit y = sin(x . w) (w a fixed random direction); switch backends with one word.

    erdma run -n 2 -- python examples/train_ddp.py --backend erdma
    torchrun --nproc-per-node 2 examples/train_ddp.py --backend gloo
    erdma run -n 2 -- python examples/train_ddp.py --powersgd-start 3    # DDP's PowerSGD communication hook

Rank 0 prints the loss at the start and at the end (each the mean of 10 steps; it falls about 10x in the
default 300 steps), steps/s and, with --out, saves the final parameters and its loss at every step (``losses``)
for comparison across backends.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="erdma", choices=["erdma", "gloo"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--print-every", type=int, default=0, help="every rank prints its step count this often")
    ap.add_argument("--powersgd-start", type=int, default=0,
                    help="compress gradients with PowerSGD (rank 1) from this step on (0: plain allreduce)")
    args = ap.parse_args()
    if args.backend == "erdma":
        import erdma_core.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial model everywhere (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    ddp = DDP(model, bucket_cap_mb=1)
    if args.powersgd_start:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=args.powersgd_start, random_seed=0)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
    target = torch.randn(32, 1) / 32 ** 0.5  # x . target ~ N(0, 1): one period of sin, which the MLP can learn
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data shard
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        if args.print_every and step % args.print_every == 0:
            print(f"rank {rank} step {step}", flush=True)
        x = torch.randn(args.batch, 32, generator=gen)
        y = torch.sin(x @ target)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - start
    if rank == 0:
        first, last = losses[:10], losses[-10:]
        start_loss, end_loss = sum(first) / len(first), sum(last) / len(last)
        print(f"backend={args.backend} world={world} steps={args.steps} loss {start_loss:.4f} -> {end_loss:.4f} "
              f"({start_loss / end_loss:.1f}x lower) steps/s={args.steps / elapsed:.1f}", flush=True)
        if args.out:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            torch.save(state | {"losses": torch.tensor(losses)}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
