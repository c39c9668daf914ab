"""The NAT matrix: two ranks, each with no NAT, a masquerade NAT (endpoint-independent mapping: "cone") or a
fully-random one ("symmetric"), every ordered pair of those (rank 1 dials rank 0), and two cones with a
firewall between the sites that drops direct traffic; over erdma-quic with the ``stun`` traversal and coturn
as the relay (``relay_when = "fallback"``: each rank offers its NAT mapping, then its relay, and the dialler
keeps the first that answers). Per cell: the path the pair took as each rank reports it, the time ``init``
took (STUN, relay allocation, the connectivity checks and QUIC handshakes; the slower rank) and the result
of 20 allreduces. Needs root, iproute2, nftables and coturn.

    python benchmarks/matrix.py
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path

from erdma_p2p.lab.jobs import RELAY, run_job
from erdma_p2p.lab.natlab import NatLab

KINDS = ("none", "cone", "symmetric")


def main() -> int:
    print("| rank 0 | rank 1 (dials) | path (as rank 0, rank 1 report it) | init (slower rank) | 20 allreduces |")
    print("|---|---|---|---|---|")
    failed = 0
    cells = [(a, b, False) for a, b in itertools.product(KINDS, repeat=2)] + [("cone", "cone", True)]
    for a, b, blocked in cells:
        kinds = (a, b)
        with tempfile.TemporaryDirectory() as tmp, NatLab(2, Path(tmp), public=frozenset(
                i for i, k in enumerate(kinds) if k == "none"), symmetric=frozenset(
                i for i, k in enumerate(kinds) if k == "symmetric")) as lab:
            if blocked:
                lab.block_direct(0, 1)
            out = run_job(lab, Path(tmp), **RELAY)
        b = b + (", firewall between the sites" if blocked else "")
        if any("error" in r for r in out):
            failed += 1
            print(f"| {a} | {b} | failed: {[r.get('error') for r in out]} | | |")
            continue
        paths = ", ".join(r["paths"][str(1 - rank)] for rank, r in enumerate(out))
        ok = "bit for bit" if all(r["wrong"] == 0 for r in out) else "WRONG"
        print(f"| {a} | {b} | {paths} | {max(r['init_s'] for r in out):.2f} s | {ok} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
