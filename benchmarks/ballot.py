"""What deciding one step costs the members of an elastic job, by where membership is decided.

    python -m benchmarks.ballot --members 3 --steps 40

Each way runs the same number of member processes on loopback, started together, deciding ``--steps`` steps
back to back; a step is every member's vote and the outcome, as an elastic group decides after each allreduce:

- ``mesh``: no store. Write-once registers (``elastic.paxos``) decided among the members over their mesh
  (``elastic.mesh``): each member decides its own vote (all members are the acceptors) and waits until it has
  learned every member's vote (``Chosen``; it reads one not learned within 0.5 s); the first member then
  decides the outcome (the others learn it, and decide it themselves only if it has not come within 1 s).
- ``etcd``: ``membership.Ballot.decide`` on a 3-member etcd cluster (``--store etcd://``).
- ``tcp``: ``membership.Ballot.decide`` on the TCP store one process serves (``erdma run --elastic``).

Printed: each way's median time per step over the members, and the mesh's as a ratio of the others'.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SECRET = b"ballot benchmark secret"


def _mesh_member(me: int, n: int, steps: int, folder: str, barrier: Any, out: Any) -> None:
    from erdma_core.elastic.mesh import Mesh
    from erdma_core.elastic.registers import Registers

    ids = [f"m{i}" for i in range(n)]

    def where(m: str) -> tuple[str, int] | None:
        try:
            host, port = Path(folder, m).read_text().split()
        except (OSError, ValueError):
            return None
        return host, int(port)

    box = Mesh(SECRET, "bench", ids[me], where)
    Path(folder, ids[me] + ".tmp").write_text(f"{box.address[0]} {box.address[1]}")
    os.rename(Path(folder, ids[me] + ".tmp"), Path(folder, ids[me]))
    regs = Registers(ids[me], box.channel(0), retry_s=0.2)
    barrier.wait()
    start = time.perf_counter()
    for s in range(steps):
        regs.decide(f"vote/1/{s}/{me}", b"done", ids, 60.0)
        for m in range(n):
            key, give_up = f"vote/1/{s}/{m}", time.monotonic() + 60.0
            while regs.wait_learned(key, 0.5) is None and regs.read(key, ids, 60.0) is None:
                if time.monotonic() > give_up:  # (a member that has not voted yet: wait for it)
                    raise RuntimeError(f"{key} undecided after 60 s")
        # the outcome follows from the votes; member 0 writes it (what the step admits) and the others learn it
        outcome = f"vote/1/{s}/outcome"
        if me == 0 or regs.wait_learned(outcome, 1.0) is None:
            regs.decide(outcome, b"commit", ids, 60.0)
        if s >= 2:
            regs.forget(f"vote/1/{s - 2}/")
    out.put((time.perf_counter() - start) / steps)
    barrier.wait()  # answering the others until every member is done
    regs.close()
    box.close()


def _store_member(me: int, n: int, steps: int, url: str, barrier: Any, out: Any) -> None:
    from erdma_core.api.join import load_config
    from erdma_core.elastic import open_store
    from erdma_core.elastic.membership import Ballot, Keys

    store = open_store(url, load_config({"discovery.init_method": url, "security.secret": SECRET.decode()}))
    keys = Keys("bench")
    barrier.wait()
    start = time.perf_counter()
    for s in range(steps):
        outcome = Ballot(store, keys, 1, s, me, n).decide(True, set, time.monotonic() + 60, 5.0)
        if not outcome.commit:
            raise RuntimeError(f"step {s} aborted")
    out.put((time.perf_counter() - start) / steps)
    barrier.wait()
    store.close()


def _run(target: Any, n: int, steps: int, where: str) -> list[float]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=target, args=(i, n, steps, where, barrier, out)) for i in range(n)]
    for p in procs:
        p.start()
    times = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    from erdma_core.discovery.store import TCPStore
    from erdma_core.testing.etcd import EtcdCluster, missing

    results: dict[str, list[float]] = {}
    results["mesh"] = _run(_mesh_member, args.members, args.steps, tempfile.mkdtemp(prefix="erdma-ballot-"))
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=10, secret=SECRET)
    try:
        results["tcp"] = _run(_store_member, args.members, args.steps, f"tcp://127.0.0.1:{server.port}")
    finally:
        server.close()
    if missing():
        print(f"etcd: skipped ({missing()})")
    else:
        with EtcdCluster(3) as cluster:
            results["etcd"] = _run(_store_member, args.members, args.steps, cluster.url("bench"))
    print(f"{args.members} members, {args.steps} steps each; per step, the median over the members:")
    med = {k: statistics.median(v) for k, v in results.items()}
    for k, v in results.items():
        print(f"  {k:5s} {1000 * med[k]:8.2f} ms   (members: {', '.join(f'{1000 * t:.2f}' for t in v)})")
    for k in ("etcd", "tcp"):
        if k in med:
            print(f"  mesh / {k}: {med['mesh'] / med[k]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
