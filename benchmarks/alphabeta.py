"""Scaling check: eRDMA's measured allreduce time against the alpha-beta model on an emulated link.

alpha (per-message latency) is half the median UDP round trip and B the TCP bulk rate, both measured on
the same link first. For P ranks and N bytes:

    ring:              T = 2(P-1)*alpha + 2(P-1)/P * N/B
    halving-doubling:  T = 2*log2(P)*alpha + 2(P-1)/P * N/B        (P a power of two)

Every rank has its own access link of rate B each way, as the lab builds it, so the model's B is per rank.
The model has no contention and no loss; the `drops` column counts packets the lab's rate limiters dropped
during the run (queue overflow: two senders briefly sharing one rank's downlink, or a burst larger than the
one-BDP queue), which TCP then recovers at a cost the model does not include.

    python -m benchmarks.alphabeta --ranks 2,3,4,5,6,7,8 --rtt-ms 10 --rate-mbit 50 --size 4M
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.ceiling import PROBE, ROOT, flows
from benchmarks.launch import run_job
from benchmarks.netlab.topology import Lab, LinkSpec
from erdma_core.cli.bench import human, parse_size


def link_parameters(spec: LinkSpec, seconds: float = 4.0) -> tuple[float, float]:
    """(alpha in seconds, B in bytes/s) measured on a 2-rank lab with this link."""
    with Lab(2, spec) as lab:
        echo = lab.popen(1, [*PROBE, "echo", "--port", "9000", "--idle", "10"], cwd=ROOT, stdout=subprocess.PIPE,
                         text=True)
        assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
        r = subprocess.run(lab.command(0, [*PROBE, "ping", "--host", lab.addr(1), "--port", "9000", "--count", "50",
                                           "--interval-ms", "5"]), cwd=ROOT, capture_output=True, text=True, check=True)
        echo.kill()
        echo.wait()
        rtt_ms = json.loads(r.stdout)["rtt_median_ms"]
        bulk = flows(lab, [(0, 1)], seconds)[0]
    return rtt_ms / 2e3, bulk["mbit_s"] * 1e6 / 8


def model(algorithm: str, p: int, n: int, alpha: float, b: float) -> float | None:
    transfer = 2 * (p - 1) / p * n / b
    if algorithm == "ring":
        return 2 * (p - 1) * alpha + transfer
    if p & (p - 1):  # halving-doubling's formula holds for powers of two
        return None
    return 2 * math.log2(p) * alpha + transfer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.alphabeta", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,3,4,5,6,7,8")
    ap.add_argument("--rtt-ms", type=float, default=10.0)
    ap.add_argument("--rate-mbit", type=float, default=50.0)
    ap.add_argument("--size", default="4M")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    spec = LinkSpec(rtt_ms=args.rtt_ms, rate_mbit=args.rate_mbit)
    n = parse_size(args.size)
    alpha, b = link_parameters(spec)
    print(f"link: rtt {args.rtt_ms} ms, rate {args.rate_mbit} Mbit/s per rank; measured alpha = {alpha * 1e3:.2f} ms, "
          f"B = {b * 8 / 1e6:.1f} Mbit/s; N = {human(n)}")
    print(f"{'P':>3} {'algorithm':>17} {'measured (ms)':>14} {'model (ms)':>11} {'measured/model':>15} "
          f"{'drops':>7}")
    rows: list[dict[str, Any]] = []
    for p in [int(x) for x in args.ranks.split(",")]:
        with Lab(p, spec) as lab:
            for algorithm in ("ring", "halving_doubling"):
                expect = model(algorithm, p, n, alpha, b)
                if expect is None:
                    continue
                before = lab.queue_drops()
                res = run_job("erdma", p, ["--op", "allreduce", "--sizes", args.size, "--iters", str(args.iters),
                                           "--warmup", "1", "--small-warmup", "1", "--algorithm", algorithm], lab)
                drops = lab.queue_drops() - before
                t = res[0]["time_us"] * 1e-6
                rows.append({"ranks": p, "algorithm": algorithm, "measured_s": t, "model_s": expect,
                             "ratio": t / expect, "wrong": res[0]["wrong"], "queue_drops": drops})
                print(f"{p:>3} {algorithm:>17} {t * 1e3:>14.1f} {expect * 1e3:>11.1f} {t / expect:>15.2f} "
                      f"{drops:>7}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"alpha_s": alpha, "B_bytes_s": b, "size": n, "rows": rows}, indent=1))
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
