"""Each codec on real gradients: compression ratio, encode and decode throughput (GB/s of raw fp32), and the
error relative to the gradient's norm, on this machine's CPU (``--device cuda`` on a GPU).

    python plugins/erdma-gpucomp/benchmarks/codecs.py [--device cpu] [--repeats 5] [--layers 4] [--d-model 256]

The gradients: one backward pass of a transformer encoder (by default 4 layers, d_model 256, about 3.7 M
parameters) on random tokens, flattened to one float32 vector and cut into messages of ``--message-mib``
(4 MiB: the core's default chunk), as the executor hands them to a codec. Encoding ends with the encoded
bytes in host memory (they go to a socket next); decoding starts from host bytes and writes host memory, as
a receiving rank does. With ``--device cuda`` encoding is timed twice: from host memory (what the core hands
a codec today: upload, kernels, download) and from GPU memory (a message that already lives on the GPU),
and nvcomp's own codecs (cascaded, bitcomp, ans, gdeflate) are added; they decode on the GPU.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from erdma_gpucomp.plugin import make

CODECS = ["fp16", "bf16", "int8", "int4", "topk", "lz4", "zstd"]
GPU_ONLY = ["cascaded", "bitcomp", "ans", "gdeflate"]


def gradients(layers: int, d_model: int) -> np.ndarray:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, batch_first=True)
    model = nn.Sequential(nn.Embedding(1000, d_model), nn.TransformerEncoder(layer, layers), nn.Linear(d_model, 1000))
    tokens = torch.randint(0, 1000, (16, 64))
    loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 1000), tokens.reshape(-1))
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().astype(np.float32)


def best(repeats: int, fn) -> tuple[float, object]:
    """The shortest of ``repeats`` timed calls of ``fn`` and the last one's result."""
    took, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        took = min(took, time.perf_counter() - t0)
    return took, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--message-mib", type=float, default=4)
    args = ap.parse_args()
    g = gradients(args.layers, args.d_model)
    step = int(args.message_mib * (1 << 18))
    chunks = [g[i:i + step] for i in range(0, g.size, step)]
    gpu = args.device == "cuda"
    names = CODECS + (GPU_ONLY if gpu else [])
    print(f"{g.size} gradient elements ({g.nbytes / 2**20:.1f} MiB fp32) in {len(chunks)} messages of "
          f"{args.message_mib:g} MiB; device {args.device}; best of {args.repeats}")
    print(f"{'codec':<9} {'ratio':>7} {'encode GB/s':>12} {'from GPU':>9} {'decode GB/s':>12} {'rel. error':>11}")
    on_gpu = None
    if gpu:
        import cupy

        on_gpu = [cupy.asarray(c) for c in chunks]
    for name in names:
        if name in GPU_ONLY:
            codec = make(name)
        elif name in ("lz4", "zstd"):
            codec = make(name, device=args.device)
        else:
            codec = make(name, device=args.device, error_feedback=False)
        ratio, enc, dev, dec, out = measure(codec, chunks, on_gpu, args.repeats)
        err = np.linalg.norm(out - g) / np.linalg.norm(g)
        from_gpu = f"{g.nbytes / dev / 1e9:.2f}" if dev else ""
        print(f"{name:<9} {ratio:>7.2f} {g.nbytes / enc / 1e9:>12.2f} {from_gpu:>9} {g.nbytes / dec / 1e9:>12.2f} "
              f"{err:>11.2e}", flush=True)


def measure(codec, chunks: list[np.ndarray], on_gpu: list | None, repeats: int) -> tuple:
    """(ratio, encode s from host, encode s from GPU or None, decode s, the decoded gradient)."""
    enc_t, encoded = best(repeats, lambda: [codec.encode(c, "float32", None) for c in chunks])
    dev_t = best(repeats, lambda: [codec.encode(c, "float32", None) for c in on_gpu])[0] if on_gpu else None

    def decode_all() -> list[np.ndarray]:
        outs = []
        for c, e in zip(chunks, encoded, strict=True):
            out = np.empty_like(c)
            codec.decode(memoryview(np.frombuffer(e.payload, np.uint8)), bytes(e.meta), "float32", out)
            outs.append(out)
        return outs

    dec_t, outs = best(repeats, decode_all)
    raw = sum(c.nbytes for c in chunks)
    sent = sum(len(memoryview(e.payload).cast("B")) + len(e.meta) for e in encoded)
    return raw / sent, enc_t, dev_t, dec_t, np.concatenate(outs)


if __name__ == "__main__":
    main()
