"""Rounds and bytes per rank of one float32 allreduce through an aggregation node, measured (the rank's
datagram counters, headers and tags included), next to the ring's, counted from its compiled schedule
(payload only; each of its messages adds a 64-byte frame header).

    python plugins/erdma-naca/benchmarks/rounds_bytes.py --ranks 4 --sizes 4K,1M,64M
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from erdma_naca.serve import address_of

from erdma_core.algorithms import ring
from erdma_core.algorithms.schedule import Spec
from erdma_core.cli.bench import parse_size
from erdma_core.testing.world import World


def one(pg: Any, n: int) -> dict[str, int]:
    x = np.ones(n, np.float32)
    pg.allreduce(x)  # the group's set-up (JOIN, agreement) out of the way
    before = pg.counters()
    pg.allreduce(x)
    after = pg.counters()
    assert (x == pg.size() ** 2).all()
    return {k: after[k] - before.get(k, 0) for k in after if k.startswith("naca.")}


def ring_counts(p: int, n: int, chunk_bytes: int) -> tuple[int, int, int]:
    """(steps, messages, payload bytes) rank 0 sends in the ring allreduce of n float32."""
    steps = ring.allreduce(Spec("allreduce", 0, p, n))
    per = max(1, chunk_bytes // 4)
    sends = [c for s in steps for x in s.sends for c in range(0, max(x.count, 1), per)]
    return len(steps), len(sends), sum(x.count for s in steps for x in s.sends) * 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--sizes", default="4K,1M,64M")
    args = ap.parse_args()
    os.environ.setdefault("ERDMA_PLUGINS", "naca")
    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / "secret"
        secret.write_text(secrets.token_hex(32))
        node = subprocess.Popen([sys.executable, "-m", "erdma_core.cli", "naca", "serve", "--host", "127.0.0.1",
                                 "--secret-file", str(secret)], stdout=subprocess.PIPE, text=True)
        address = address_of(node)
        cfg = {"collectives.allreduce": "naca", "algorithm.allreduce.naca.nodes": address,
               "algorithm.allreduce.naca.secret_file": str(secret)}
        print("| size | naca rounds | naca datagrams sent/received | naca bytes sent/received | ring steps | "
              "ring messages sent | ring payload bytes sent (= received) |\n|---|---|---|---|---|---|---|")
        try:
            with World(args.ranks, config=cfg, timeout=600) as world:
                for text in args.sizes.split(","):
                    n = parse_size(text) // 4
                    got = world.run(one, n)[0]
                    steps, msgs, nbytes = ring_counts(args.ranks, n, 4 << 20)
                    print(f"| {text} | 2 | {got['naca.datagrams_sent']}/{got['naca.datagrams_received']} | "
                          f"{got['naca.bytes_sent']}/{got['naca.bytes_received']} | {steps} | {msgs} | {nbytes} |")
        finally:
            node.terminate()
            node.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
