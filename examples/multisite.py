"""The multi-site pattern of decentralized training (INTELLECT-1's ElasticDeviceMesh, HSDP with DiLoCo):
the ranks of one site shard the model with FSDP2 over the site's fast backend (Gloo here; NCCL on GPUs),
and one group per shard index spans the sites for the outer step, on eRDMA (compressed when
``compression.name`` is set). Inner steps never leave a site; every ``--inner-steps`` the sites average
their pseudo-gradients (how far the inner steps moved each shard) across sites and take a Nesterov outer step.

    erdma run -n 4 -- python examples/multisite.py --sites 2                    # cross-site groups on eRDMA
    ERDMA_COMPRESSION_NAME=int8 erdma run -n 4 -- python examples/multisite.py  # ... sending int8
    erdma run -n 4 -- python examples/multisite.py --cross-backend gloo         # the same job all on Gloo

Ranks 0..k-1 are site 0, k..2k-1 site 1, and so on. Rank 0 prints the bytes each site sent to the others,
with and without compression, then one JSON line: the held-out loss before and after, a hash of the final
parameters and the bytes every rank's cross-site collectives sent.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

DIM = 64


def teacher(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(DIM, 8, generator=torch.Generator().manual_seed(1234)) / DIM ** 0.5
    x = torch.randn(n, DIM, generator=gen)
    return x, torch.tanh(x @ w).sum(dim=1, keepdim=True)


def cross_bytes(group: dist.ProcessGroup, raw: int) -> int:
    """Bytes this rank's cross-site collectives sent: eRDMA counts what its compressor put on the wire; an
    uncompressed 2-site allreduce sends each byte of the message once (ring: half, then half)."""
    backend = group._get_backend(torch.device("cpu"))
    counters = backend.pg.counters() if hasattr(backend, "pg") else {}
    wire = [v for k, v in counters.items() if k.endswith((".wire_bytes", "small.raw_bytes", "skipped.raw_bytes",
                                                           "declined.raw_bytes"))]
    return sum(wire) if wire else raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--cross-backend", default="erdma", help="the backend of the cross-site groups")
    ap.add_argument("--outer-steps", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="rank 0 saves its final parameter shards here (torch.save)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.sites:
        raise SystemExit(f"{world} ranks do not split into {args.sites} sites of equal size")
    per_site = world // args.sites
    site, index = divmod(rank, per_site)
    local = cross = None
    for s in range(args.sites):  # every rank makes every group, in the same order
        g = dist.new_group(list(range(s * per_site, (s + 1) * per_site)), backend="gloo")
        local = g if s == site else local
    for i in range(per_site):
        g = dist.new_group([s * per_site + i for s in range(args.sites)], backend=args.cross_backend)
        cross = g if i == index else cross
    assert local is not None and cross is not None

    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(nn.Linear(DIM, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    fully_shard(model, mesh=DeviceMesh.from_group(local, "cpu"))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    shards = [p.to_local() for p in model.parameters()]  # this rank's shards: the same index in every site
    anchor = [s.detach().clone() for s in shards]  # the parameters of the last outer step
    momentum = [torch.zeros_like(s) for s in shards]
    # one pseudo-gradient buffer per shard, kept across outer steps: a lossy compressor's error feedback
    # follows a buffer by its memory (torch.distributed passes no key), so a temporary would hand its residual
    # to whatever tensor the allocator puts at that address next
    pseudos = [torch.empty_like(s) for s in shards]
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    held_out = teacher(512, torch.Generator().manual_seed(7))

    def evaluate() -> float:
        with torch.no_grad():
            return nn.functional.mse_loss(model(held_out[0]), held_out[1]).item()

    before, raw = evaluate(), 0
    for _ in range(args.outer_steps):
        for _ in range(args.inner_steps):
            x, y = teacher(64, gen)
            inner.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()  # FSDP2 reduce-scatters the gradients in the site
            inner.step()
        with torch.no_grad():
            for s, a, m, pseudo in zip(shards, anchor, momentum, pseudos, strict=True):
                torch.sub(a, s, out=pseudo)  # how far this site's inner steps moved the shard
                dist.all_reduce(pseudo, group=cross)  # across the sites: the outer step's one collective
                pseudo /= args.sites
                raw += pseudo.numel() * pseudo.element_size()
                m.mul_(0.9).add_(pseudo)
                a.sub_(0.7 * (pseudo + 0.9 * m))  # Nesterov, outer learning rate 0.7
                s.copy_(a)
    after = evaluate()
    digest = hashlib.sha256(b"".join(a.numpy().tobytes() for a in anchor))
    mine = torch.tensor([cross_bytes(cross, raw), raw], dtype=torch.int64)
    every = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, mine)  # what each rank's cross-site collectives sent
    total = torch.stack(every).sum(dim=0)
    if rank == 0 and args.out:
        torch.save(anchor, args.out)
    if rank == 0:
        for s in range(args.sites):  # what left each site, and what it would have been uncompressed
            sent, plain = (int(x) for x in torch.stack(every[s * per_site:(s + 1) * per_site]).sum(dim=0))
            print(f"site {s} sent {sent / 1e6:.2f} MB to the other sites ({plain / 1e6:.2f} MB uncompressed, "
                  f"{sent / plain:.2f}x)", flush=True)
        print(json.dumps({"cross_backend": args.cross_backend, "loss_before": before, "loss_after": after,
                          "params": digest.hexdigest(), "cross_site_bytes": int(total[0]),
                          "pseudo_gradient_bytes": int(total[1])}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
