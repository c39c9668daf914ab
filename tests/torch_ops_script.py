"""Run by tests/test_torch_backend.py on every rank: each torch.distributed op through the erdma backend,
checked against the values every rank can compute itself. Prints OK or raises.
With TORCH_OPS_DEVICE=cuda every tensor lives on the rank's GPU (staged through host memory by the backend
while the transport moves host memory only)."""

import os

import torch
import torch.distributed as dist

import erdma_core.torch  # noqa: F401

dist.init_process_group("erdma")
r, p = dist.get_rank(), dist.get_world_size()
device = os.environ.get("TORCH_OPS_DEVICE", "cpu")
if device == "cuda":
    device = f"cuda:{r % torch.cuda.device_count()}"
    torch.cuda.set_device(device)
torch.set_default_device(device)
tri = p * (p + 1) / 2

t = torch.full((5,), float(r + 1))
dist.all_reduce(t)
assert t.tolist() == [tri] * 5, t
t = torch.full((5,), float(r + 1))
dist.all_reduce(t, op=dist.ReduceOp.MAX)
assert t.tolist() == [float(p)] * 5, t
ts = [torch.full((3,), float(r)), torch.full((2,), 1.0)]
dist.all_reduce_coalesced(ts)
assert ts[0].tolist() == [tri - p] * 3 and ts[1].tolist() == [float(p)] * 2, ts
t = torch.full((4,), float(r))
dist.broadcast(t, p - 1)
assert t.tolist() == [float(p - 1)] * 4
out = torch.zeros(3 * p)
dist.all_gather_into_tensor(out, torch.full((3,), float(r)))
assert out.tolist() == [float(q) for q in range(p) for _ in range(3)], out
outs = [torch.zeros(2, dtype=torch.int64) for _ in range(p)]
dist.all_gather(outs, torch.full((2,), r, dtype=torch.int64))
assert [o.tolist() for o in outs] == [[q, q] for q in range(p)]
o = torch.zeros(2)
dist.reduce_scatter_tensor(o, torch.arange(2.0 * p) + r)
assert o.tolist() == [p * (2 * r) + tri - p, p * (2 * r + 1) + tri - p], o
o = torch.zeros(2)
dist.reduce_scatter(o, [torch.full((2,), float(q + r)) for q in range(p)])
assert o.tolist() == [p * r + tri - p] * 2, o
o = torch.zeros(p)
dist.all_to_all_single(o, torch.arange(float(p)) + 10 * r)
assert o.tolist() == [10.0 * q + r for q in range(p)], o
send = [(r + q) % 2 + 1 for q in range(p)]
recv = [(q + r) % 2 + 1 for q in range(p)]
o = torch.zeros(sum(recv))
dist.all_to_all_single(o, torch.cat([torch.full((s,), float(10 * r + q)) for q, s in enumerate(send)]),
                       output_split_sizes=recv, input_split_sizes=send)
assert o.tolist() == [float(10 * q + r) for q, s in enumerate(recv) for _ in range(s)], o
outs = [torch.zeros(1) for _ in range(p)]
dist.all_to_all(outs, [torch.full((1,), float(10 * r + q)) for q in range(p)])
assert [x.item() for x in outs] == [10.0 * q + r for q in range(p)]
dist.barrier()
t = torch.full((3,), float(r + 1))
dist.reduce(t, 0)
assert r != 0 or t.tolist() == [tri] * 3
g = [torch.zeros(2) for _ in range(p)] if r == 0 else None
dist.gather(torch.full((2,), float(r)), g, dst=0)
assert r != 0 or [x.tolist() for x in g] == [[float(q)] * 2 for q in range(p)]
s = torch.zeros(2)
dist.scatter(s, [torch.full((2,), float(q)) for q in range(p)] if r == 0 else None, src=0)
assert s.tolist() == [float(r)] * 2
if r == 0:
    dist.send(torch.ones(2) * 5, 1, tag=3)
elif r == 1:
    x = torch.zeros(2)
    dist.recv(x, 0, tag=3)
    assert x.tolist() == [5.0, 5.0]
t = torch.ones(2)
w = dist.all_reduce(t, async_op=True)
w.wait()
assert w.get_future().value()[0].tolist() == [float(p)] * 2
sub = dist.new_group([0, 1])
if r < 2:
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t, group=sub)
    assert t.tolist() == [3.0, 3.0]
assert t.device == torch.device(device), t.device
dist.destroy_process_group()
print("OK")
