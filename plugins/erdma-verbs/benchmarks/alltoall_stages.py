"""The seeds' sequential all-to-all experiment, eRDMA's side (runs inside the test guest): 3 ranks, each
sending BYTES to every rank, an all-to-all repeated STAGES times with the ``sequential`` or ``pairwise``
algorithm over a transport; prints the seconds the stages took on the slowest rank (after init and a
barrier, as the MPI program times them), after checking every byte of the last stage. The whole run (process
start to exit, as ``time`` measured the report's programs) is timed outside, as ``mpirun`` is
(``run_alltoall.py``): from inside, the interpreter's start and the first imports would be left out.

    python alltoall_stages.py TRANSPORT ALGORITHM STAGES [BYTES] [KEY=VALUE ...]

``KEY=VALUE``: config overrides for every rank (``transport.verbs.spin_us=20000``), printed with the result.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

import numpy as np
from ranks import overrides, run_ranks

WORLD = 3


def rank_main(rank: int, url: str, transport: str, algorithm: str, stages: int, nbytes: int, extra: dict[str, int | str],
              out: mp.Queue) -> None:
    import erdma_core

    pg = erdma_core.init({"transport.name": transport, **extra}, rank=rank, world_size=WORLD, init_method=url)
    send = np.zeros((WORLD, nbytes), np.uint8)
    recv = np.zeros((WORLD, nbytes), np.uint8)
    pg.barrier()
    start = time.perf_counter()
    for s in range(stages):
        for p in range(WORLD):
            send[p] = (rank * 31 + p * 7 + s) & 0xFF
        pg.alltoall(recv, send, algorithm=algorithm)
    took = time.perf_counter() - start
    want = np.array([[(p * 31 + rank * 7 + stages - 1) & 0xFF] * nbytes for p in range(WORLD)], np.uint8)
    out.put((rank, took, bool(np.array_equal(recv, want))))
    pg.destroy()


def main() -> int:
    transport, algorithm, stages = sys.argv[1], sys.argv[2], int(sys.argv[3])
    nbytes = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
    extra = overrides(sys.argv[5:])
    results, exited = run_ranks(WORLD, rank_main, transport, algorithm, stages, nbytes, extra)
    ok = all(r[2] for r in results) and exited
    print(f"erdma transport={transport} algorithm={algorithm} stages={stages} bytes={nbytes} "
          f"seconds={max(r[1] for r in results):.4f} "
          f"{'ok' if ok else 'WRONG'}" + "".join(f" {k}={v}" for k, v in extra.items()), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
