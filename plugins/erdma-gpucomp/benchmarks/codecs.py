"""Each codec on real gradients: compression ratio, encode and decode throughput (GB/s of raw fp32), and the
error relative to the gradient's norm, on this machine's CPU (``--device cuda`` on a GPU).

    python plugins/erdma-gpucomp/benchmarks/codecs.py [--device cpu] [--repeats 5]

The gradients: one backward pass of a small transformer encoder (4 layers, d_model 256, about 3.7 M
parameters) on random tokens, flattened to one float32 vector and cut into 4 MiB messages (the core's
default chunk), as the executor hands them to a codec.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make

CODECS = ["fp16", "bf16", "int8", "int4", "topk", "lz4", "zstd"]


def gradients() -> np.ndarray:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    model = nn.Sequential(nn.Embedding(1000, 256), nn.TransformerEncoder(layer, 4), nn.Linear(256, 1000))
    tokens = torch.randint(0, 1000, (16, 64))
    loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 1000), tokens.reshape(-1))
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    g = gradients()
    chunks = [g[i:i + (1 << 20)] for i in range(0, g.size, 1 << 20)]
    print(f"{g.size} gradient elements ({g.nbytes / 2**20:.1f} MiB fp32) in {len(chunks)} messages; device "
          f"{args.device}; best of {args.repeats}")
    print(f"{'codec':<7} {'ratio':>7} {'encode GB/s':>12} {'decode GB/s':>12} {'rel. error':>11}")
    for name in CODECS:
        codec = make(name, device=args.device, error_feedback=False) if name not in ("lz4", "zstd") \
            else make(name, device=args.device)
        enc_t = dec_t = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            encoded = [codec.encode(c, "float32", None) for c in chunks]
            t1 = time.perf_counter()
            outs = []
            for c, e in zip(chunks, encoded, strict=True):
                out = np.empty_like(c)
                codec.decode(memoryview(np.frombuffer(e.payload, np.uint8)), bytes(e.meta), "float32", out)
                outs.append(out)
            t2 = time.perf_counter()
            enc_t, dec_t = min(enc_t, t1 - t0), min(dec_t, t2 - t1)
        sent = sum(len(memoryview(e.payload).cast("B")) + len(e.meta) for e in encoded)
        err = np.linalg.norm(np.concatenate(outs) - g) / np.linalg.norm(g)
        print(f"{name:<7} {g.nbytes / sent:>7.2f} {g.nbytes / enc_t / 1e9:>12.2f} {g.nbytes / dec_t / 1e9:>12.2f} "
              f"{err:>11.2e}", flush=True)


if __name__ == "__main__":
    main()
