"""One rank of a 2-rank QUIC job that a stranger floods (tests/test_flood.py), started by the test with
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the QUIC settings in the environment:

    python flood_job.py STOP_FILE

It runs allreduces, each checked bit for bit against numpy, until STOP_FILE exists (one at least: on a busy
machine rank 1's join can end after the flood did, when the file is already there); every half second rank 0
samples its resident memory and the QUIC connection objects alive in it (sessions, connections of either
engine, the compiled engine's connections). Prints one JSON line: iterations, wrong results, the samples'
first and largest memory, the most connection objects seen and those alive at the end.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

import erdma_core


def rss() -> int:
    """This process's resident memory, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def connection_objects() -> dict[str, int]:
    """Live objects of the classes a QUIC connection is made of, by class name."""
    from erdma_quic.aioquic_engine import Quic
    from erdma_quic.mesh import Session
    from erdma_quic.ngtcp2 import connection as engine
    from erdma_quic.ngtcp2.mesh_connection import EngineConnection

    kinds = {"session": Session, "aioquic": Quic, "engine": EngineConnection, "ngtcp2": engine.Connection}
    counts = dict.fromkeys(kinds, 0)
    for obj in gc.get_objects():
        for name, cls in kinds.items():
            if isinstance(obj, cls):
                counts[name] += 1
    return counts


def main() -> int:
    stop = Path(sys.argv[1])
    t0 = time.monotonic()
    pg = erdma_core.init()
    joined = time.monotonic() - t0
    r = pg.rank()
    samples: list[tuple[int, dict[str, int]]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            samples.append((rss(), connection_objects()))

    sampler = threading.Thread(target=sample, daemon=True)
    if r == 0:
        samples.append((rss(), connection_objects()))
        sampler.start()
    iters = wrong = 0
    while True:  # one checked allreduce at least: the stop file may be there before a slow join ends
        arr = ((np.arange(4096, dtype=np.int64) * (r + 1) + iters) % 4096).astype(np.float32)
        want = sum(((np.arange(4096, dtype=np.int64) * (k + 1) + iters) % 4096) for k in range(2)).astype(np.float32)
        pg.allreduce(arr)
        wrong += int(not np.array_equal(arr.view(np.uint32), want.view(np.uint32)))
        iters += 1
        flag = np.array([stop.exists()], dtype=np.int32)
        pg.allreduce(flag, op=erdma_core.ReduceOp.MAX)  # every rank stops at the same iteration
        if flag[0]:
            break
        time.sleep(0.01)
    done.set()
    if sampler.is_alive():
        sampler.join()  # (its list of every object would keep what the collection below frees)
    out = {"rank": r, "iters": iters, "wrong": wrong, "init_s": round(joined, 2)}
    if r == 0:
        gc.collect()  # what a collection would free is no leak; what it does not is
        out |= {"rss_first": samples[0][0], "rss_max": max(s[0] for s in samples),
                "objects_max": {k: max(s[1][k] for s in samples) for k in samples[0][1]},
                "objects_end": connection_objects(), "pending": pg.transport.pending_accepts(),
                "refusals": list(pg.transport.mesh.refusals)[-2:]}
    print(json.dumps(out), flush=True)
    pg.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
