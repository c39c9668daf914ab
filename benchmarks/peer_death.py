"""Peer-death trials: N ranks run allreduces of random sizes; after a random delay one random rank is killed
(SIGKILL). Every survivor must fail with PeerLostError naming the rank that died; this reports how many did
and how long each took to notice (from the kill to the error, on the survivor's clock).

    python -m benchmarks.peer_death --transport tcp --trials 100
    python -m benchmarks.peer_death --transport quic --trials 100

Exit code 1 when any survivor failed otherwise (another error, another rank blamed, no error at all)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

from erdma_core.testing.world import World


def until_a_peer_dies(pg: Any, seed: int) -> tuple[str, int | None, float, int]:
    """Allreduce until something fails; return (error class, the rank it blames, when, allreduces done)."""
    rng = np.random.default_rng(seed + pg.rank())
    sizes = [1 << k for k in range(10, 23)]  # 1 KiB .. 4 MiB of float32
    done = 0
    while True:
        n = sizes[int(np.random.default_rng(seed + done).integers(len(sizes)))] // 4  # the same on every rank
        try:
            pg.allreduce(rng.random(n, dtype=np.float32))
        except Exception as exc:  # the outcome under test
            return type(exc).__name__, getattr(exc, "peer", None), time.time(), done
        done += 1


def trial(size: int, config: dict[str, Any], seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    victim, delay = rnd.randrange(size), rnd.uniform(0.05, 1.0)
    with World(size, config, timeout=120) as world:
        box: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: box.setdefault("out", world.outcomes(until_a_peer_dies, seed)))
        runner.start()
        time.sleep(delay)
        killed_at = time.time()
        world.kill(victim)
        runner.join(150)
    out = box.get("out") or ["no outcome"] * size
    survivors = []
    for rank, o in enumerate(out):
        if rank == victim:
            continue
        if isinstance(o, tuple):
            cls, blamed, at, done = o
            survivors.append({"rank": rank, "error": cls, "blamed": blamed, "detect_s": at - killed_at, "ops": done})
        else:
            survivors.append({"rank": rank, "error": repr(o), "blamed": None, "detect_s": None, "ops": None})
    ok = all(s["error"] == "PeerLostError" and s["blamed"] == victim for s in survivors)
    return {"seed": seed, "victim": victim, "delay_s": delay, "ok": ok, "survivors": survivors}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="write every trial as JSON here")
    args = ap.parse_args(argv)
    config: dict[str, Any] = {"transport.name": args.transport, "timeouts.collective": 60.0,
                              "security.secret": "peer-death-trials"}
    results = []
    for i in range(args.trials):
        r = trial(args.ranks, config, args.seed * 1000 + i)
        results.append(r)
        if not r["ok"]:
            print(f"trial {i}: victim {r['victim']}: {r['survivors']}", file=sys.stderr)
    times = sorted(s["detect_s"] for r in results for s in r["survivors"] if s["detect_s"] is not None)
    good = sum(r["ok"] for r in results)
    q = statistics.quantiles(times, n=100) if len(times) > 1 else times * 99
    print(f"{args.transport}, {args.ranks} ranks: {good}/{len(results)} trials with every survivor failing with "
          f"PeerLostError naming the dead rank; detection over {len(times)} survivors: min {times[0]:.3f} s, "
          f"median {statistics.median(times):.3f} s, p90 {q[89]:.3f} s, p99 {q[98]:.3f} s, max {times[-1]:.3f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if good == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
