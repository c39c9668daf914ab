"""One rank of a lab job: ``allreduce`` N times, each result checked bit for bit against numpy, then
``destroy`` right after the last one (what a rank sent last must still arrive after it closes).

    python tests/lab/lossy_job.py ITERS COUNT [PAUSE_AT PAUSE_RANK READY_FILE GO_FILE]

With PAUSE_AT, rank PAUSE_RANK creates READY_FILE before allreduce number PAUSE_AT and waits for GO_FILE (the
test changes the network then); the other rank goes on, sends its part and waits in that allreduce. Prints
one JSON line: iterations, wrong results, seconds."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

import erdma_core


def main() -> int:
    iters, count = int(sys.argv[1]), int(sys.argv[2])
    pause_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    pauser = int(sys.argv[4]) if pause_at >= 0 else -1
    ready, go = (Path(sys.argv[5]), Path(sys.argv[6])) if pause_at >= 0 else (None, None)
    pg = erdma_core.init()
    p, r = pg.size(), pg.rank()
    wrong = 0
    t0 = time.monotonic()
    for i in range(iters):
        if i == pause_at and r == pauser and ready is not None and go is not None:
            ready.touch()
            while not go.exists():
                time.sleep(0.01)
        # integers below 2**24 in float32: every reduction order gives the same bits
        arr = ((np.arange(count, dtype=np.int64) * (r + 1) + i) % 4096).astype(np.float32)
        want = sum(((np.arange(count, dtype=np.int64) * (k + 1) + i) % 4096) for k in range(p)).astype(np.float32)
        pg.allreduce(arr)
        wrong += int(not np.array_equal(arr.view(np.uint32), want.view(np.uint32)))
    seconds = time.monotonic() - t0
    pg.destroy()
    print(json.dumps({"rank": r, "iters": iters, "wrong": wrong, "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
