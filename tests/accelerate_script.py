"""Run by tests/test_torch_clients.py on every rank (erdma run or torchrun): Hugging Face accelerate training
a small model on the backend named in argv[1]. On CPU accelerate always picks Gloo (or MPI) for the group it
makes, and refuses another name (``InitProcessGroupKwargs(backend=...)``: "Your assigned backend ... is not
available"); it uses a default group that exists already. So the script makes it first, by name, as the
README says. Rank 0 prints one JSON line: the backend torch runs, the losses, gather/reduce results and a
hash of the trained parameters."""

import hashlib
import json
import sys

import torch
import torch.distributed as dist

dist.init_process_group(sys.argv[1])  # before Accelerator(): it keeps the default group it finds

from accelerate import Accelerator  # noqa: E402

accelerator = Accelerator(cpu=True)
rank, world = accelerator.process_index, accelerator.num_processes
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = accelerator.prepare(model, optimizer)
gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
losses = []
for _ in range(20):
    x = torch.randn(64, 16, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
gathered = accelerator.gather(torch.tensor([rank * 10 + 1])).tolist()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in accelerator.unwrap_model(model).parameters()))
if rank == 0:
    print(json.dumps({"backend": dist.get_backend(), "world": world, "losses": losses, "gathered": gathered,
                      "params": digest.hexdigest()}), flush=True)
accelerator.end_training()  # destroys the default group
