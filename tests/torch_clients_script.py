"""Run by tests/test_torch_clients.py on every rank: what PyTorch's own clients ask of a backend beyond the
plain ops. argv: backend ("erdma", "cpu:erdma" or "gloo"), a checkpoint folder. Rank 0 writes its results
as JSON next to that folder (``<folder>.json``) for the test to compare across backends; every rank prints "done".

- BAND, BOR, BXOR on integer and bool tensors (all_reduce, reduce, reduce_scatter), as Gloo offers them;
- ReduceOp.AVG on int64 (Lightning's sync_dist sends it to every backend not named "gloo"): the sum divided
  by the world size, truncated toward zero as NCCL does; not run on Gloo, which has no AVG;
- an unsupported op (PREMUL_SUM) refused with a message naming it;
- torch.distributed.checkpoint: async_save then load, which needs the group to serve the CPU device;
- inputs erdma accepts and Gloo refuses (not run on Gloo): all_to_all with tensors of uneven sizes, and
  all_gather_into_tensor into a stacked (world, n) output, which NCCL documents.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import erdma_core.torch  # noqa: F401  (registers the backend)

backend, folder = sys.argv[1], sys.argv[2]
dist.init_process_group(backend)
r, p = dist.get_rank(), dist.get_world_size()
out: dict[str, object] = {"devices": sorted(d.type for d in dist.group.WORLD._device_types)}

gen = torch.Generator().manual_seed(100 + r)
for dtype in (torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool):
    for name in ("BAND", "BOR", "BXOR"):
        op = getattr(dist.ReduceOp, name)
        base = torch.randint(0, 256, (33,), generator=gen).to(dtype)
        t = base.clone()
        dist.all_reduce(t, op=op)
        out[f"all_reduce {name} {dtype}"] = t.tolist()
        t = base.clone()
        dist.reduce(t, dst=p - 1, op=op)
        out[f"reduce {name} {dtype}"] = t.tolist() if r == p - 1 else None
        o = torch.zeros(11, dtype=dtype)
        dist.reduce_scatter_tensor(o, base, op=op)
        out[f"reduce_scatter {name} {dtype}"] = o.tolist()
    if dtype in (torch.int32, torch.bool):  # an op on floats is refused, naming op and dtype
        try:
            dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BXOR)
        except Exception as exc:
            out["bxor on float32"] = f"{type(exc).__name__}: {exc}"

if "gloo" not in backend:
    for dtype in (torch.int64, torch.int32, torch.uint8):
        lo = 0 if dtype == torch.uint8 else -50
        t = torch.arange(lo, lo + 60, dtype=dtype) * (r + 1) + int(r == 0)  # sums not divisible by p
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out[f"avg {dtype}"] = t.tolist()
    outs = [torch.zeros(q + 1) for q in range(p)]  # from rank q: q + 1 elements
    dist.all_to_all(outs, [torch.full((r + 1,), float(10 * r + q)) for q in range(p)])
    out["uneven all_to_all"] = [o.tolist() for o in outs]
    stacked = torch.zeros(p, 3)
    dist.all_gather_into_tensor(stacked, torch.full((3,), float(r)))
    out["stacked all_gather_into_tensor"] = stacked.tolist()
    try:
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
    except Exception as exc:
        out["premul_sum"] = f"{type(exc).__name__}: {exc}"

state = {"w": torch.arange(12.0).reshape(3, 4) + 100 * r, "step": torch.tensor(7 + r)}
dcp.async_save(state, checkpoint_id=folder).result()
loaded = {"w": torch.zeros(3, 4), "step": torch.tensor(0)}
dcp.load(loaded, checkpoint_id=folder)
out["dcp"] = {"w": loaded["w"].tolist(), "step": loaded["step"].item()}

if r == 0:  # a file, not stdout: torchrun's ranks share one pipe, and another rank's line can cut into this one
    Path(folder + ".json").write_text(json.dumps(out))
print("done", flush=True)
dist.destroy_process_group()
