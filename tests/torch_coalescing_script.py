"""torch's _coalescing_manager on an "erdma" group, with and without a device, async and not: allreduce,
all_gather_single, reduce_scatter_single and point-to-point ops in a block, each result compared with
the sum it must be. Prints one line: OK, or what went wrong."""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

dist.init_process_group("erdma")
rank, world = dist.get_rank(), dist.get_world_size()
total = float(sum(range(1, world + 1)))
problems: list[str] = []
cpu = torch.device("cpu")

for device in (cpu, None):
    for async_ops in (True, False):
        case = f"device={device} async_ops={async_ops}"
        a, b = torch.full((5,), rank + 1.0), torch.full((7,), 2.0 * (rank + 1))
        with _coalescing_manager(device=device, async_ops=async_ops) as cm:
            dist.all_reduce(a)
            dist.all_reduce(b)
        if async_ops:
            cm.wait()
        if not (torch.equal(a, torch.full((5,), total)) and torch.equal(b, torch.full((7,), 2 * total))):
            problems.append(f"allreduce {case}: {a.tolist()} {b.tolist()}")
        ins = [torch.full((3,), rank + 1.0), torch.full((2,), -(rank + 1.0))]
        outs = [torch.empty(3 * world), torch.empty(2 * world)]
        with _coalescing_manager(device=device, async_ops=async_ops) as cm:
            for o, i in zip(outs, ins, strict=True):
                dist.all_gather_single(o, i)
        if async_ops:
            cm.wait()
        want = [torch.arange(1.0, world + 1).repeat_interleave(3), -torch.arange(1.0, world + 1).repeat_interleave(2)]
        if not all(torch.equal(o, w) for o, w in zip(outs, want, strict=True)):
            problems.append(f"all_gather_single {case}: {[o.tolist() for o in outs]}")
        ins = [torch.arange(4.0 * world) + rank, torch.ones(2 * world)]
        outs = [torch.empty(4), torch.empty(2)]
        with _coalescing_manager(device=device, async_ops=async_ops) as cm:
            for o, i in zip(outs, ins, strict=True):
                dist.reduce_scatter_single(o, i)
        if async_ops:
            cm.wait()
        want = [(torch.arange(4.0 * world) * world + sum(range(world)))[4 * rank:4 * rank + 4],
                torch.full((2,), float(world))]
        if not all(torch.equal(o, w) for o, w in zip(outs, want, strict=True)):
            problems.append(f"reduce_scatter_single {case}: {[o.tolist() for o in outs]}")

# point-to-point in a block with a device (what batch_isend_irecv does on a backend that coalesces)
got = torch.empty(4)
with _coalescing_manager(device=cpu, async_ops=True) as cm:
    dist.isend(torch.full((4,), float(rank)), (rank + 1) % world)
    dist.irecv(got, (rank - 1) % world)
cm.wait()
if not torch.equal(got, torch.full((4,), float((rank - 1) % world))):
    problems.append(f"isend/irecv in a block: {got.tolist()}")
dist.destroy_process_group()
print("OK" if not problems else "; ".join(problems), flush=True)
