"""One rank of a test job: allreduce ITERS times (results checked bit for bit), then print one JSON line
with the addresses this rank published and how it reaches each peer (direct or relayed), or what went wrong
(and after how many allreduces and seconds).

    JOB_PAUSE=SECONDS python -m erdma_p2p.lab.job ITERS COUNT    (JOB_PAUSE: a pause after each allreduce; default none)

JOB_STARTED=DIR: after its first allreduce the rank writes DIR/RANK, the paths to its peers as JSON (what a test
that breaks something mid-job waits for: ``jobs.wait_started``).

JOB_EXIT=RANK:ITER: rank RANK exits at once (``os._exit``, no goodbye) before its allreduce ITER.

JOB_RING=group-order runs the allreduces in a group whose ring ignores slow (relayed) links: a baseline.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import erdma_core


def main() -> int:
    iters, count = int(sys.argv[1]), int(sys.argv[2])
    pause = float(os.environ.get("JOB_PAUSE", "0"))  # seconds between two allreduces
    start = time.monotonic()
    try:
        pg = erdma_core.init()
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    init_s = time.monotonic() - start
    world = pg
    if os.environ.get("JOB_RING") == "group-order":  # a benchmark's baseline: the ring ignores slow links
        pg.slow_links = frozenset()
        pg = world.new_group(list(range(world.size())))
    p, r = pg.size(), pg.rank()
    t = getattr(pg.transport, "parts", (pg.transport,))[0]  # the first of a paired transport
    # what it published: QUIC's candidates, TCP's meeting candidates or listening address
    key = "quic/addr" if t.name == "QUIC" else f"{t.key}/meet" if getattr(t, "meeting", None) else f"{t.key}/addr"
    advertised = pg.store.get(f"{key}/{r}", 1.0).decode()  # now: rank 0's destroy empties a file store
    wrong = 0
    in_allreduce = 0.0  # seconds inside allreduce (the rest makes and checks the data)
    t0 = time.monotonic()
    exit_rank, _, exit_iter = os.environ.get("JOB_EXIT", "-1:0").partition(":")
    for i in range(iters):
        if r == int(exit_rank) and i == int(exit_iter):
            os._exit(3)
        arr = ((np.arange(count, dtype=np.int64) * (r + 1) + i) % 4096).astype(np.float32)
        want = sum(((np.arange(count, dtype=np.int64) * (k + 1) + i) % 4096) for k in range(p)).astype(np.float32)
        try:
            t1 = time.monotonic()
            pg.allreduce(arr)
            in_allreduce += time.monotonic() - t1
        except Exception as exc:
            print(json.dumps({"rank": r, "iters": i, "error": f"{type(exc).__name__}: {exc}",
                              "after_s": time.monotonic() - t0}), flush=True)
            return 1
        wrong += int(not np.array_equal(arr, want))
        if i == 0 and os.environ.get("JOB_STARTED"):
            _started(os.environ["JOB_STARTED"], r, pg)
        time.sleep(pause)
    seconds = time.monotonic() - t0
    lanes = getattr(pg.transport, "lane_stats", dict)()  # erdma-quic striping: parts per lane
    paths = _paths(pg)
    print(json.dumps({"rank": r, "iters": iters, "wrong": wrong, "advertised": advertised, "seconds": seconds,
                      "allreduce_s": in_allreduce, "counters": pg.counters(),
                      "paths": paths, "transports": _transports(pg), "ring": list(pg.ring),
                      "init_s": init_s, "lane_parts": sum(lanes.get("parts_out", [0])[1:])}),
          flush=True)
    world.destroy()
    return 0


def _paths(pg: erdma_core.ProcessGroup) -> dict[str, str]:
    """How this rank reaches each peer: "direct" or "relayed", by peer."""
    return {str(peer): how.split()[1] for peer, how in pg.paths().items()}


def _transports(pg: erdma_core.ProcessGroup) -> dict[str, str]:
    """Which transport carries each peer ("TCP", "QUIC"), by peer."""
    t = pg.transport
    return {str(peer): how.split()[2] if len(how.split()) > 2 else t.name for peer, how in pg.paths().items()}


def _started(folder: str, rank: int, pg: erdma_core.ProcessGroup) -> None:
    where = Path(folder) / str(rank)
    where.with_suffix(".tmp").write_text(json.dumps(_paths(pg)))
    where.with_suffix(".tmp").rename(where)  # whole or not there


if __name__ == "__main__":
    sys.exit(main())
