"""allreduce over DPDK/memif, over the built-in TCP transport on loopback and with torch.distributed Gloo, on
one host, 64 KiB to 64 MiB, through the benchmark lab's launcher (``erdma bench`` in every rank, results
checked): the systems alternate ROUNDS times; the table gives each one's median time, the ratios against
Gloo and TCP, and the CPU seconds all ranks spent per GB of the allreduce's buffer (every thread of every rank,
during the timed iterations).

With ``--memif-copy``, memif without its zero-copy client mode runs alternated with the others too (its own
columns: time, and CPU against TCP's).

With ``--veth`` (root; 2 ranks), the same again between two network namespaces joined by one veth pair
(``netlab.veth``, MTU 9000): erdma-dpdk's af_packet against the built-in TCP and Gloo over that kernel link.

    python -m benchmarks.dpdk_allreduce [--ranks 2,4] [--rounds 2] [--sizes 64K,...,64M] [--memif-copy] [--veth]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.launch import run_job
from benchmarks.netlab.veth import VethPair

SYSTEMS = ("erdma-dpdk", "erdma-tcp", "gloo")
VETH_SYSTEMS = ("erdma-dpdk-af_packet", "erdma-tcp", "gloo")


def human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


Rows = dict[tuple[str, int], list[dict]]


def _rounds(systems: tuple[str, ...], n: int, args: argparse.Namespace, pair: VethPair | None = None) -> Rows:
    rows: Rows = {}
    for r in range(args.rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for system in order:
            bench = ["--op", "allreduce", "--sizes", args.sizes, "--iters", str(args.iters), "--warmup", "2",
                     "--small-warmup", "20"]
            for row in run_job(system, n, bench, lab=pair, timeout=1800):
                assert row["wrong"] == 0, (system, row)
                rows.setdefault((system, row["size"]), []).append(row)
    return rows


def table(title: str, systems: tuple[str, ...], rows: Rows) -> None:
    """dpdk, tcp and gloo first; any further system (memif's copy mode) gets its time and CPU against TCP's."""
    dpdk, tcp, gloo, *more = systems
    extra = "".join(f" | {m} (ms) | {m}/tcp time | CPU s/GB {m} | {m}/tcp CPU" for m in more)
    print(f"\n| allreduce, {title}, float32 | dpdk (ms) | tcp (ms) | gloo (ms) | dpdk/tcp time | gloo/dpdk "
          f"| CPU s/GB dpdk | tcp | gloo | dpdk/tcp CPU{extra} |")
    print("|---" * (10 + 4 * len(more)) + "|")
    for size in sorted({s for _, s in rows}):
        t = {s: statistics.median(x["time_us"] for x in rows[(s, size)]) / 1e3 for s in systems}
        c = {s: statistics.median(x["cpu_s_per_gb"] for x in rows[(s, size)]) for s in systems}
        cells = "".join(f" | {t[m]:.3f} | {t[m] / t[tcp]:.2f} | {c[m]:.2f} | {c[m] / c[tcp]:.2f}" for m in more)
        print(f"| {human(size)} | {t[dpdk]:.3f} | {t[tcp]:.3f} | {t[gloo]:.3f} | {t[dpdk] / t[tcp]:.2f} "
              f"| {t[gloo] / t[dpdk]:.2f} | {c[dpdk]:.2f} | {c[tcp]:.2f} | {c[gloo]:.2f} | {c[dpdk] / c[tcp]:.2f}"
              f"{cells} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--memif-copy", action="store_true", help="also memif without its zero-copy client mode")
    ap.add_argument("--veth", action="store_true", help="also over a veth pair between two namespaces (2 ranks)")
    args = ap.parse_args()
    systems = (*SYSTEMS, "erdma-dpdk-copy") if args.memif_copy else SYSTEMS
    for n in (int(x) for x in args.ranks.split(",")):
        table(f"{n} ranks, loopback (dpdk: memif)", systems, _rounds(systems, n, args))
    if args.veth:
        with VethPair() as pair:
            table(f"2 ranks, a veth pair, MTU {pair.mtu} (dpdk: af_packet)", VETH_SYSTEMS,
                  _rounds(VETH_SYSTEMS, 2, args, pair))
    return 0


if __name__ == "__main__":
    sys.exit(main())
