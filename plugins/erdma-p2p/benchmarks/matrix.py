"""The NAT matrix: two ranks, each with no NAT, a masquerade NAT (endpoint-independent mapping: "cone") or a
fully-random one ("symmetric"), every pair of those, over erdma-quic with the ``stun`` traversal and coturn
as the relay (``relay_when = "dependent-mapping"``). Per cell: whether each rank is direct or relayed, the
time ``init`` took (discovery, STUN, relay allocation, QUIC handshakes; the slower rank) and the result of
20 allreduces. Needs root, iproute2, nftables and coturn.

    python benchmarks/matrix.py
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from natlab import NatLab
from test_nat import RELAY, TURN_HOSTS, run_job

KINDS = ("none", "cone", "symmetric")


def main() -> int:
    print("| rank 0 | rank 1 | paths | init (slower rank) | 20 allreduces |")
    print("|---|---|---|---|---|")
    failed = 0
    for a, b in itertools.combinations_with_replacement(KINDS, 2):
        kinds = (a, b)
        with tempfile.TemporaryDirectory() as tmp, NatLab(2, Path(tmp), public=frozenset(
                i for i, k in enumerate(kinds) if k == "none"), symmetric=frozenset(
                i for i, k in enumerate(kinds) if k == "symmetric")) as lab:
            out = run_job(lab, Path(tmp), **RELAY)
        if any("error" in r for r in out):
            failed += 1
            print(f"| {a} | {b} | failed: {[r.get('error') for r in out]} | | |")
            continue
        paths = ", ".join("relayed" if r["advertised"].rsplit(":", 1)[0] in TURN_HOSTS else "direct" for r in out)
        ok = "bit for bit" if all(r["wrong"] == 0 for r in out) else "WRONG"
        print(f"| {a} | {b} | {paths} | {max(r['init_s'] for r in out):.2f} s | {ok} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
