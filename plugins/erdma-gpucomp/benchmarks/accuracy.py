"""Does a lossy codec train like uncompressed? A student MLP learns a fixed teacher MLP under DDP over eRDMA,
once per compressor setting, same seeds and data; the table gives each run's held-out loss after training and
its ratio to the uncompressed run's.

    python plugins/erdma-gpucomp/benchmarks/accuracy.py [--ranks 2] [--steps 400]

Each setting is a separate ``erdma run`` of this file with ``--worker`` (ERDMA_COMPRESSION and the codec's
error_feedback set in its environment; compression.min_bytes 0 so every gradient message is encoded).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

SETTINGS = [("none", None), ("int8", True), ("int8", False), ("int4", True), ("int4", False),
            ("topk", True), ("topk", False)]


def worker(steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import erdma_core.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("erdma")
    rank = dist.get_rank()

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))

    torch.manual_seed(1)
    teacher = mlp()
    torch.manual_seed(2)
    student = DDP(mlp(), bucket_cap_mb=1)
    opt = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        held_x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(7))
        held_y = teacher(held_x)
    for _ in range(steps):
        x = torch.randn(64, 64, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(student(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        held = nn.functional.mse_loss(student.module(held_x), held_y).item()
    if rank == 0:
        print(f"RESULT {held:.6g}", flush=True)
    dist.destroy_process_group()


def run(ranks: int, steps: int, codec: str, feedback: bool | None) -> float:
    env = dict(os.environ, ERDMA_COMPRESSION=codec, ERDMA_COMPRESSION_MIN_BYTES="0")
    if feedback is not None:
        env[f"ERDMA_COMPRESSION_{codec.upper()}_ERROR_FEEDBACK"] = str(feedback).lower()
    out = subprocess.run(["erdma", "run", "-n", str(ranks), "--", sys.executable, __file__, "--worker",
                          "--steps", str(steps)], env=env, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if "RESULT" in line:
            return float(line.split("RESULT")[1])
    raise RuntimeError(f"{codec} (error feedback {feedback}) failed:\n{out.stdout}\n{out.stderr}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.steps)
        return
    print(f"student learns teacher, DDP over eRDMA, {args.ranks} ranks, {args.steps} steps, held-out MSE:")
    print(f"{'compressor':<10} {'error feedback':<15} {'held-out loss':>14} {'/ uncompressed':>15}")
    base = None
    for codec, feedback in SETTINGS:
        loss = run(args.ranks, args.steps, codec, feedback)
        base = base if base is not None else loss
        fb = "-" if feedback is None else ("on" if feedback else "off")
        print(f"{codec:<10} {fb:<15} {loss:>14.6f} {loss / base:>15.4f}", flush=True)


if __name__ == "__main__":
    main()
