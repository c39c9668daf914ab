"""One rank of a test job: allreduce ITERS times (results checked bit for bit), then print one JSON line
with the address this rank advertised, or what went wrong (and after how many allreduces and seconds).

    python job.py ITERS COUNT
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import erdma_core


def main() -> int:
    iters, count = int(sys.argv[1]), int(sys.argv[2])
    start = time.monotonic()
    try:
        pg = erdma_core.init()
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    init_s = time.monotonic() - start
    p, r = pg.size(), pg.rank()
    wrong = 0
    t0 = time.monotonic()
    for i in range(iters):
        arr = ((np.arange(count, dtype=np.int64) * (r + 1) + i) % 4096).astype(np.float32)
        want = sum(((np.arange(count, dtype=np.int64) * (k + 1) + i) % 4096) for k in range(p)).astype(np.float32)
        try:
            pg.allreduce(arr)
        except Exception as exc:
            print(json.dumps({"rank": r, "iters": i, "error": f"{type(exc).__name__}: {exc}",
                              "after_s": time.monotonic() - t0}), flush=True)
            return 1
        wrong += int(not np.array_equal(arr, want))
    seconds = time.monotonic() - t0
    lanes = getattr(pg.rt.transport, "lane_stats", dict)()  # erdma-quic striping: parts per lane
    advertised = pg.rt.store.get(f"quic/addr/{r}", 1.0).decode()
    print(json.dumps({"rank": r, "iters": iters, "wrong": wrong, "advertised": advertised, "seconds": seconds,
                      "init_s": init_s, "lane_parts": sum(lanes.get("parts_out", [0])[1:])}),
          flush=True)
    pg.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
