"""eRDMA's side of the ping-pong (``run_pingpong.py``; runs inside the test guest): 2 ranks, rank 0 sends BYTES
to rank 1 with ``ProcessGroup.send``, which sends them back, N times after a warm-up round of N; prints the
microseconds per round trip.

    python pingpong_stages.py TRANSPORT N [BYTES] [KEY=VALUE ...]
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

import numpy as np
from ranks import overrides, run_ranks


def rank_main(rank: int, url: str, transport: str, n: int, nbytes: int, extra: dict[str, int | str],
              out: mp.Queue) -> None:
    import erdma_core

    pg = erdma_core.init({"transport.name": transport, **extra}, rank=rank, world_size=2, init_method=url)
    buf = np.zeros(nbytes, np.uint8)
    took = 0.0
    for _ in range(2):
        pg.barrier()
        start = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                pg.send(buf, 1)
                pg.recv(buf, 1)
            else:
                pg.recv(buf, 0)
                pg.send(buf, 0)
        took = time.perf_counter() - start
    out.put((rank, took))
    pg.destroy()


def main() -> int:
    transport, n = sys.argv[1], int(sys.argv[2])
    nbytes = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    extra = overrides(sys.argv[4:])
    took = dict(run_ranks(2, rank_main, transport, n, nbytes, extra, timeout=1800)[0])
    how = "".join(f",{k}={v}" for k, v in extra.items())
    print(f"pingpong system=erdma-{transport}{how} bytes={nbytes} usec={took[0] / n * 1e6:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
