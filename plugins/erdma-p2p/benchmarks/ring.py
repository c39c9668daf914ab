"""A ring allreduce that keeps a relayed pair apart, against one that does not: four ranks behind masquerade
NATs, a firewall between sites 1 and 2 (that pair goes through coturn), erdma-quic, ``algorithm = "ring"``.
The ranks agree on the relayed pair and ring through 0, 1, 3, 2; the baseline (the job's ``JOB_RING =
group-order``) rings through 0, 1, 2, 3, with the relayed link between neighbours. Alternated, in the same
run. Needs root, iproute2, nftables and coturn.

    python benchmarks/ring.py --count 1048576 --iters 10 --repeats 3 [--relay-rate 16mbit]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from erdma_p2p.lab.jobs import RELAY, run_job
from erdma_p2p.lab.natlab import NatLab


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=1 << 20, help="float32 elements per allreduce")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--relay-rate", default="", help="cap what coturn sends to each site (tc htb rate, e.g. 16mbit)")
    args = ap.parse_args()
    runs = {"relay kept apart": {}, "group order": {"JOB_RING": "group-order"}}
    rings = {"relay kept apart": [0, 1, 3, 2], "group order": [0, 1, 2, 3]}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(args.repeats):
        for name, env in (list(runs.items()) if rep % 2 == 0 else list(runs.items())[::-1]):
            with tempfile.TemporaryDirectory() as tmp, NatLab(4, Path(tmp)) as lab:
                lab.block_direct(1, 2)
                if args.relay_rate:
                    lab.cap_relay(args.relay_rate)
                out = run_job(lab, Path(tmp), iters=args.iters, count=args.count, ERDMA_ALGORITHM="ring", **RELAY,
                              **env)
            if any("error" in r or r["wrong"] for r in out):
                print(f"{name}: failed: {out}")
                return 1
            if any(r["ring"] != rings[name] or r["paths"].get(str(3 - i if i in (1, 2) else -1), "relayed")
                   != "relayed" for i, r in enumerate(out)):
                print(f"{name}: not the ring or paths meant: {out}")
                return 1
            times[name].append(max(r["seconds"] for r in out) / args.iters)
    nbytes = args.count * 4
    cap = f" (relay capped at {args.relay_rate})" if args.relay_rate else ""
    print(f"4 ranks behind masquerade NATs, ranks 1 and 2 relayed{cap}, erdma-quic ring allreduce of "
          f"{nbytes / 2**20:g} MiB, {args.iters} iterations, {args.repeats} repeats alternated (median)")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"  {name:>16} {rings[name]}: {t * 1e3:8.1f} ms per allreduce, {nbytes / t / 1e6:6.1f} MB/s")
    print(f"  group order / relay kept apart: "
          f"{statistics.median(times['group order']) / statistics.median(times['relay kept apart']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
