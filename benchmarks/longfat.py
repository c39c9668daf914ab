"""A long, fat link that one TCP flow cannot fill, and a pool of connections that does (``transport.tcp.
connections``). On the lab's ``longfat`` scenario (300 ms RTT, 150 Mbit/s each way per rank), two ranks:

1. what the path carries: bulk TCP flows in both directions at once (``benchmarks.netlab.probe``), one per
   direction (what one flow's window allows, with the hosts' default buffers) and eight per direction (what
   the emulated link carries: the reference for "the link");
2. an allreduce of each size by eRDMA with one connection per pair and with pools, every eRDMA case with the
   hosts' default socket buffers (``socket_buffer_bytes = 0``) and also one with eRDMA's default (4 MiB, fixed),
   and by Gloo, the systems alternated within each repeat.

Bus bandwidth of a 2-rank allreduce equals what each direction of the link carries, so each is printed as
Mbit/s and as a fraction of the link's nominal rate and of what eight raw flows carried. Needs root.

    python -m benchmarks.longfat --sizes 64M,256M --repeats 2 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.ceiling import flows
from benchmarks.launch import run_job
from benchmarks.netlab.topology import Lab
from benchmarks.scenarios import scenario

HOST_BUFFERS = {"ERDMA_TRANSPORT_TCP_SOCKET_BUFFER_BYTES": "0"}
CASES: dict[str, tuple[str, dict[str, str]]] = {  # name: (system, environment)
    "erdma c=1": ("erdma", HOST_BUFFERS | {"ERDMA_TRANSPORT_TCP_CONNECTIONS": "1"}),
    "erdma c=4": ("erdma", HOST_BUFFERS | {"ERDMA_TRANSPORT_TCP_CONNECTIONS": "4"}),
    "erdma c=8": ("erdma", HOST_BUFFERS | {"ERDMA_TRANSPORT_TCP_CONNECTIONS": "8"}),
    "erdma 4MiB c=1": ("erdma", {"ERDMA_TRANSPORT_TCP_CONNECTIONS": "1"}),
    "gloo": ("gloo", {}),
}


def raw(lab: Lab, per_direction: int, seconds: float) -> float:
    """Mbit/s per direction of ``per_direction`` bulk flows each way, at once."""
    got = flows(lab, [(0, 1)] * per_direction + [(1, 0)] * per_direction, seconds)
    return statistics.mean([sum(r["mbit_s"] for r in got[:per_direction]),
                            sum(r["mbit_s"] for r in got[per_direction:])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.longfat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64M,256M")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=40.0, help="length of each raw flow measurement")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    spec = scenario("longfat")
    assert spec is not None and spec.rate_mbit is not None
    cases = {name: CASES[name] for name in args.cases.split(",")}
    bench = ["--op", "allreduce", "--sizes", args.sizes, "--iters", str(args.iters), "--warmup", "1",
             "--max-seconds", "600"]
    busbw: dict[tuple[str, int], list[float]] = {}
    with Lab(2, spec) as lab:
        one, eight = raw(lab, 1, args.seconds), raw(lab, 8, args.seconds)
        for rep in range(args.repeats):
            names = list(cases)
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                system, env = cases[name]
                for row in run_job(system, 2, bench, lab, timeout=1800, erdma_env=env):
                    assert row["wrong"] == 0, (name, row)
                    busbw.setdefault((name, row["size"]), []).append(row["busbw"] * 8000)  # GB/s -> Mbit/s
                print(f"  repeat {rep + 1}: {name} done", file=sys.stderr, flush=True)
    link = spec.rate_mbit
    print(f"longfat: {spec.rtt_ms:.0f} ms RTT, {link:.0f} Mbit/s each way; 2 ranks, TCP {spec.cc}")
    print(f"raw TCP, both directions at once: 1 flow each way {one:.0f} Mbit/s ({one / link:.2f} of the link), "
          f"8 flows each way {eight:.0f} Mbit/s ({eight / link:.2f})")
    print(f"{'case':>16} {'size':>6} {'busbw (Mbit/s)':>15} {'of link':>8} {'of 8 flows':>11}")
    rows: list[dict[str, Any]] = []
    for (name, size), values in busbw.items():
        m = statistics.median(values)
        rows.append({"case": name, "size": size, "busbw_mbit_s": m, "of_link": m / link, "of_8_flows": m / eight})
        print(f"{name:>16} {size >> 20:>5}M {m:>15.0f} {m / link:>8.2f} {m / eight:>11.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"one_flow_mbit_s": one, "eight_flows_mbit_s": eight, "link_mbit_s": link,
                                               "rtt_ms": spec.rtt_ms, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
