"""allreduce over DPDK/memif, over the built-in TCP transport on loopback and with torch.distributed Gloo, on
one host, 64 KiB to 64 MiB, through the benchmark lab's launcher (``erdma bench`` in every rank, results
checked): the systems alternate ROUNDS times; the table gives each one's median time, the ratios against
Gloo and TCP, and the CPU seconds all ranks spent per GB of the allreduce's buffer (every thread of every rank,
during the timed iterations).

    python -m benchmarks.dpdk_allreduce [--ranks 2,4] [--rounds 2] [--sizes 64K,...,64M]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.launch import run_job

SYSTEMS = ("erdma-dpdk", "erdma-tcp", "gloo")


def human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    for n in (int(x) for x in args.ranks.split(",")):
        rows: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            order = SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[:r % len(SYSTEMS)]
            for system in order:
                bench = ["--op", "allreduce", "--sizes", args.sizes, "--iters", str(args.iters), "--warmup", "2",
                         "--small-warmup", "20"]
                for row in run_job(system, n, bench, timeout=1800):
                    assert row["wrong"] == 0, (system, row)
                    rows.setdefault((system, row["size"]), []).append(row)
        print(f"\n| allreduce, {n} ranks, float32 | dpdk (ms) | tcp (ms) | gloo (ms) | gloo/dpdk | tcp/dpdk "
              "| CPU s/GB dpdk | tcp | gloo |")
        print("|---|---|---|---|---|---|---|---|---|")
        for size in sorted({s for _, s in rows}):
            t = {s: statistics.median(x["time_us"] for x in rows[(s, size)]) / 1e3 for s in SYSTEMS}
            c = {s: statistics.median(x["cpu_s_per_gb"] for x in rows[(s, size)]) for s in SYSTEMS}
            print(f"| {human(size)} | {t['erdma-dpdk']:.2f} | {t['erdma-tcp']:.2f} | {t['gloo']:.2f} "
                  f"| {t['gloo'] / t['erdma-dpdk']:.2f} | {t['erdma-tcp'] / t['erdma-dpdk']:.2f} "
                  f"| {c['erdma-dpdk']:.2f} | {c['erdma-tcp']:.2f} | {c['gloo']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
