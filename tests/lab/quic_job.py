"""One rank of a lab job over QUIC: ``allreduce`` N times, each result checked bit for bit against numpy.

    python tests/lab/quic_job.py ITERS COUNT [SIGNAL_FILE]

With SIGNAL_FILE, rank 0 creates it after a third of the iterations (the test rebinds the NAT then).
Prints one JSON line: iterations, wrong results, seconds, and the QUIC transport's per-peer link counters
(reconnections, resumed sessions, accepted 0-RTT flights, parts sent again), and how many accepted
connections are still pending (neither joined nor refused).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

import erdma_core


def main() -> int:
    iters, count = int(sys.argv[1]), int(sys.argv[2])
    signal_file = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    pg = erdma_core.init()
    p, r = pg.size(), pg.rank()
    wrong = 0
    t0 = time.monotonic()
    for i in range(iters):
        # integers below 2**24 in float32: every reduction order gives the same bits
        arr = ((np.arange(count, dtype=np.int64) * (r + 1) + i) % 4096).astype(np.float32)
        want = sum(((np.arange(count, dtype=np.int64) * (k + 1) + i) % 4096) for k in range(p)).astype(np.float32)
        pg.allreduce(arr)
        wrong += int(not np.array_equal(arr.view(np.uint32), want.view(np.uint32)))
        if signal_file is not None and r == 0 and i == iters // 3:
            signal_file.touch()
    seconds = time.monotonic() - t0
    t = pg.transport
    links = {str(k): v for k, v in t.link_stats().items()}
    print(json.dumps({"rank": r, "iters": iters, "wrong": wrong, "seconds": seconds, "links": links,
                      "pending_accepts": t.pending_accepts()}), flush=True)
    pg.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
