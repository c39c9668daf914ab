"""DiLoCo on an elastic group: peers take inner steps alone, then average their pseudo-gradients (how far
their inner steps moved the model) in an outer step, while peers come and go.

    erdma run --elastic -n 4 -- python examples/diloco.py            # prints how to add a peer
    erdma run --join 127.0.0.1:PORT --secret-file F -n 1 -- python examples/diloco.py

The model is a small numpy MLP fitting a fixed teacher function; each peer draws its own training data. The
shared state is the global model and the outer optimizer's momentum: after every outer step each peer
prints the state's hash and the members, identical on every member. ``--compress int8`` sends the
pseudo-gradients as int8 with error feedback (needs erdma-gpucomp).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from erdma_core import elastic

DIM = 32


def teacher(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    w = np.random.default_rng(1234).standard_normal((DIM, 8)).astype(np.float32) / np.sqrt(DIM)
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x, np.tanh(x @ w).sum(axis=1, keepdims=True).astype(np.float32)


def unpack(p: np.ndarray) -> tuple[np.ndarray, ...]:
    hidden = (p.size - 1) // (DIM + 2)
    a = DIM * hidden
    return p[:a].reshape(DIM, hidden), p[a:a + hidden], p[a + hidden:a + 2 * hidden].reshape(hidden, 1), p[-1:]


def loss_and_grad(p: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    w1, b1, w2, b2 = unpack(p)
    h = np.tanh(x @ w1 + b1)
    err = h @ w2 + b2 - y
    g_out = 2 * err / len(x)
    g_h = (g_out @ w2.T) * (1 - h * h)
    grad = np.concatenate([(x.T @ g_h).ravel(), g_h.sum(0), (h.T @ g_out).ravel(), g_out.sum(0)])
    return float(np.mean(err * err)), grad.astype(np.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outer-steps", type=int, default=40)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--inner-lr", type=float, default=0.05)
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds each inner step also sleeps (stands "
                    "in for a bigger model's compute)")
    ap.add_argument("--compress", choices=("none", "int8"), default="none")
    ap.add_argument("--hidden", type=int, default=128, help="hidden units: the model has (32 + 2) x hidden + 1 "
                    "float32 parameters (128: 17 KiB; 123362: 16 MiB)")
    ap.add_argument("--data-seed", type=int, default=None, help="draw the training data from this seed plus the "
                    "peer's rank when it joined (default: each peer from fresh entropy)")
    args = ap.parse_args()

    init = np.random.default_rng(0)
    scale = 0.1 * min(1.0, (128 / args.hidden) ** 0.5)  # a wider layer starts smaller (its sum stays in range)
    params = (init.standard_normal((DIM + 2) * args.hidden + 1) * scale).astype(np.float32)
    momentum = np.zeros_like(params)
    config = {"compression.name": "int8", "compression.min_bytes": 0} if args.compress == "int8" else {}
    try:
        group = elastic.join({"params": params, "momentum": momentum}, config)
    except elastic.JobFinishedError as exc:
        print(f"not admitted: {exc}", flush=True)
        return 0
    seed = None if args.data_seed is None else args.data_seed + group.rank()
    data = np.random.default_rng(seed)  # each peer its own data
    val_x, val_y = teacher(2048, np.random.default_rng(99))
    delta = np.empty_like(params)  # one buffer: error feedback keeps its residual per buffer
    try:
        while group.step < args.outer_steps:
            group.sync()  # newcomers admitted here receive params, momentum and the step
            local = params.copy()
            for _ in range(args.inner_steps):
                x, y = teacher(args.batch, data)
                local -= args.inner_lr * loss_and_grad(local, x, y)[1]
                if args.step_time:
                    time.sleep(args.step_time)
            np.subtract(params, local, out=delta)  # the pseudo-gradient
            t0 = time.monotonic()
            n = group.allreduce(delta)  # its average over the members
            averaging = time.monotonic() - t0
            if n == 0:
                continue  # this peer had been counted out and came back with the members' state
            momentum *= args.momentum
            momentum += delta
            params -= args.outer_lr * (delta + args.momentum * momentum)  # Nesterov
            group.step += 1
            val = loss_and_grad(params, val_x, val_y)[0]
            print(f"outer {group.step} epoch {group.epoch} members {n} [{', '.join(group.members())}] "
                  f"hash {group.state_hash()[:16]} loss {val:.5f} avg_s {averaging:.4f} at {time.time():.3f}", flush=True)
    except elastic.JobFinishedError as exc:  # the others finished the job while this peer waited on its last
        print(f"job finished: {exc}", flush=True)  # step (they left before it learned the outcome)
        return 0
    print(f"final loss {loss_and_grad(params, val_x, val_y)[0]:.5f} pid {os.getpid()}", flush=True)
    group.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
