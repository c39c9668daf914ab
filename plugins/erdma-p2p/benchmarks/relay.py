"""Relay against direct: two ranks behind two NATs (the test bed of ``erdma_p2p/lab/natlab.py``) allreduce over
erdma-quic, once connected directly (hole punched) and once through coturn (``relay_when = "always"``:
rank 1 sends to rank 0's relayed address, rank 0 answers through its allocation), and once directly with the
relay set (the same path as the first, on the relay-capable socket); the same job, alternated. Needs root,
iproute2, nftables and coturn.

    python benchmarks/relay.py --count 1048576 --iters 20 --repeats 3 [--engine aioquic]
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
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--datagram-size", type=int, default=0, help="transport.quic.datagram_size (0: path MTU less headers)")
    ap.add_argument("--engine", default="auto", choices=("auto", "ngtcp2", "aioquic"), help="transport.quic.engine")
    args = ap.parse_args()
    quic = {"ERDMA_TRANSPORT_QUIC_DATAGRAM_SIZE": str(args.datagram_size), "ERDMA_TRANSPORT_QUIC_ENGINE": args.engine}
    paths = {"direct": quic | {"ERDMA_TRAVERSAL": "stun"},
             "direct, relay set": quic | RELAY,  # the same path, on the relayed socket (relay_when = "fallback")
             "relayed": quic | RELAY | {"ERDMA_TRAVERSAL_STUN_RELAY_WHEN": "always"}}
    times: dict[str, list[float]] = {k: [] for k in paths}
    for rep in range(args.repeats):
        for name, env in (list(paths.items()) if rep % 2 == 0 else list(paths.items())[::-1]):
            with tempfile.TemporaryDirectory() as tmp, NatLab(2, Path(tmp)) as lab:
                out = run_job(lab, Path(tmp), iters=args.iters, count=args.count, **env)
            if any("error" in r or r["wrong"] for r in out):
                print(f"{name}: failed: {out}")
                return 1
            if any(r["paths"][str(1 - rank)] != name.split(",")[0] for rank, r in enumerate(out)):
                print(f"{name}: not the path meant: {out}")
                return 1
            times[name].append(max(r["seconds"] for r in out) / args.iters)
    nbytes = args.count * 4
    print(f"2 ranks behind two NATs, erdma-quic ({args.engine}, datagram_size {args.datagram_size}), allreduce of "
          f"{nbytes / 2**20:g} MiB, {args.iters} iterations, {args.repeats} repeats alternated (median)")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"  {name:>17}: {t * 1e3:8.1f} ms per allreduce, {nbytes / t / 1e6:7.1f} MB/s algorithm bandwidth")
    direct = statistics.median(times["direct"])
    print(f"  relayed/direct time: {statistics.median(times['relayed']) / direct:.2f}; direct with the relay set "
          f"/ direct: {statistics.median(times['direct, relay set']) / direct:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
