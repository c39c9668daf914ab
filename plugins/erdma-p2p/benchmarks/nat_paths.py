"""Behind NATs against in the open: two ranks allreduce on the test bed of ``erdma_p2p/lab/natlab.py``, once both
behind masquerade NATs (``traversal = "stun"``: the built-in TCP meets from its mapped ports, erdma-quic
punches) and once both on the public segment (the built-in TCP listening and dialling, no traversal); the
same job, the cases alternated within each repeat; erdma-quic likewise, punched behind the NATs and dialling
directly on the public segment. The ratio that matters is NAT-ed busbw / public busbw of
the same transport, and of either against public TCP. Needs root, iproute2, nftables and coturn.

    python benchmarks/nat_paths.py --count 4194304 --iters 20 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from erdma_p2p.lab.jobs import run_job
from erdma_p2p.lab.natlab import NatLab

CASES = {  # name: (public sites, environment)
    "tcp-public": (frozenset({0, 1}), {"ERDMA_TRANSPORT": "tcp", "ERDMA_TRAVERSAL": "direct",
                                    "ERDMA_TRANSPORT_TCP_INTERFACE": "eth0"}),
    "tcp-nat": (frozenset(), {"ERDMA_TRANSPORT": "tcp", "ERDMA_TRAVERSAL": "stun"}),
    "quic-public": (frozenset({0, 1}), {"ERDMA_TRANSPORT": "quic", "ERDMA_TRAVERSAL": "direct",
                                     "ERDMA_TRANSPORT_QUIC_INTERFACE": "eth0"}),
    "quic-nat": (frozenset(), {"ERDMA_TRANSPORT": "quic", "ERDMA_TRAVERSAL": "stun"}),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=1 << 22, help="float32 elements per allreduce")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="an ERDMA_ setting for every case's ranks (e.g. ERDMA_TRANSPORT_QUIC_GSO=true); repeatable")
    args = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.env)
    cases = {name: (CASES[name][0], CASES[name][1] | extra) for name in args.cases.split(",")}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(args.repeats):
        for name, (public, env) in (list(cases.items()) if rep % 2 == 0 else list(cases.items())[::-1]):
            with tempfile.TemporaryDirectory() as tmp, NatLab(2, Path(tmp), public=public) as lab:
                out = run_job(lab, Path(tmp), iters=args.iters, count=args.count, **env)
            if any("error" in r or r["wrong"] for r in out):
                print(f"{name}: failed: {out}")
                return 1
            times[name].append(max(r["allreduce_s"] for r in out) / args.iters)
    nbytes = args.count * 4
    print(f"2 ranks on the NAT bed (no rate limit), allreduce of {nbytes / 2**20:g} MiB, {args.iters} iterations, "
          f"{args.repeats} repeats alternated (median of the slower rank's time inside allreduce; busbw = algbw for "
          "2 ranks)")
    base = statistics.median(times["tcp-public"]) if "tcp-public" in times else None
    for name, ts in times.items():
        t = statistics.median(ts)
        vs = f", {base / t:.2f}x public TCP's busbw" if base else ""
        print(f"  {name:>18}: {t * 1e3:8.1f} ms per allreduce, {nbytes / t / 1e6:8.1f} MB/s{vs}")
    for transport in ("tcp", "quic"):
        if f"{transport}-public" in times and f"{transport}-nat" in times:
            ratio = statistics.median(times[f"{transport}-public"]) / statistics.median(times[f"{transport}-nat"])
            print(f"  {transport} behind NATs / {transport} public, busbw: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
