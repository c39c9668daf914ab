"""torch.compile with the backend named in argv[1], 2 ranks, three forms, each printing ``RESULT FORM RANK HASH``
(a hash of the parameters after 10 steps, or of a compiled function's outputs): torch.compile(DDP(model)),
DDP(torch.compile(model)), and a compiled function that calls dist.all_reduce."""

import hashlib
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

if sys.argv[1] == "erdma":
    import erdma_core.torch  # noqa: F401
dist.init_process_group(sys.argv[1])
rank = dist.get_rank()


def digest(tensors) -> str:
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()[:16]


def train(form: str) -> str:
    torch.manual_seed(rank)  # different on every rank: DDP's broadcast makes them equal
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    net = torch.compile(DDP(model)) if form == "compile(ddp)" else DDP(torch.compile(model))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(10):
        x = torch.randn(32, 16, generator=gen)
        loss = nn.functional.mse_loss(net(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return digest(model.parameters())


@torch.compile
def step(t: torch.Tensor) -> torch.Tensor:
    t = t * 2 + rank
    dist.all_reduce(t)
    return t.sin()


for form in ("compile(ddp)", "ddp(compile)"):
    print(f"RESULT {form} {rank} {train(form)}", flush=True)
print(f"RESULT compiled-allreduce {rank} {digest([step(torch.arange(8.0) + i) for i in range(3)])}", flush=True)
dist.destroy_process_group()
print("done", flush=True)
