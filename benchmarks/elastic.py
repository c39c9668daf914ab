"""Elastic groups: how long a step takes when a member dies in the middle of its allreduce, and how long the
members' step boundary takes when they admit a newcomer (its state transfer included), next to a plain
allreduce of the same size measured in the same run.

    python -m benchmarks.elastic --scenarios loopback,continental --peers 4 --elements 1M --kills 5

Each scenario runs one elastic job (``erdma_core.testing.elastic_peer``): ``peers - 1`` peers stay, one more
kills itself in the middle of its third allreduce (before one of its messages, picked at random) and a new
one takes its place, ``kills`` times. In the lab every peer has a namespace of its own (the newcomers take
the last one) and the store is served on the lab's host port."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.netlab.topology import Lab
from benchmarks.run import _commit
from benchmarks.scenarios import scenario
from erdma_core.cli.bench import parse_size
from erdma_core.testing.elastic import ElasticJob, python

STEP = re.compile(r"step \d+ n (\d+) .* took (\S+) retried (\d+) setup (\S+)")
SYNC = re.compile(r"sync took (\S+) epoch \d+ members (\d+) setup (\S+)")


def run(name: str, peers: int, elements: int, kills: int, timeout: float) -> dict[str, Any]:
    spec = scenario(name)
    lab = Lab(peers, spec, host_port=True) if spec is not None else None
    with tempfile.TemporaryDirectory(prefix="erdma-elastic-") as tmp:
        stop = Path(tmp) / "stop"
        if lab is not None:
            lab.up()
        try:
            host = lab.host_addr if lab else "127.0.0.1"
            env = {"STEPS": "1000000", "STOP_FILE": str(stop), "ELEMENTS": str(elements)}
            with ElasticJob(python("-m", "erdma_core.testing.elastic_peer"), Path(tmp), min_peers=peers, env=env,
                            host=host) as job:
                def wrap(i: int) -> list[str]:
                    return lab.command(i, []) if lab else []

                stable = [job.start(wrap=wrap(i)) for i in range(peers - 1)]
                victim = job.start({"DIE_IN": "3"}, wrap=wrap(peers - 1))
                done, end = 0, time.monotonic() + timeout
                while done < kills and time.monotonic() < end:
                    if not victim.alive():
                        done += 1
                        victim = job.start({"DIE_IN": "3"} if done < kills else {}, wrap=wrap(peers - 1))
                    time.sleep(0.05)
                time.sleep(3.0)
                stop.touch()
                codes = job.wait_all(120)
        finally:
            if lab is not None:
                lab.down()
    lines = [line for p in stable for line in p.lines]
    steps = [(int(m[1]), float(m[2]), int(m[3]), float(m[4])) for m in map(STEP.search, lines) if m]
    syncs = [(float(m[1]), int(m[2]), float(m[3])) for m in map(SYNC.search, lines) if m]

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    return {"scenario": name, "peers": peers, "elements": elements, "bytes": elements * 4, "kills": done,
            "exit_codes": codes,
            "plain_s": med([t for n, t, r, _ in steps if n == peers and not r]),
            "plain_minus_one_s": med([t for n, t, r, _ in steps if n == peers - 1 and not r]),
            "death_step_s": med([t for n, t, r, _ in steps if r]),
            "death_setup_s": med([s for n, t, r, s in steps if r]),
            "deaths_in_allreduce": sum(r for _, _, r, _ in steps) // (peers - 1),
            "admit_s": med([t for t, n, _ in syncs if n == peers]),
            "admit_setup_s": med([s for t, n, s in syncs if n == peers]),
            "admissions": sum(n == peers for _, n, _ in syncs) // (peers - 1)}


def table(rows: list[dict[str, Any]]) -> str:
    """One line per scenario; times are medians (ms) over the steps of that kind, ratios against ``plain P``."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    def x(v: float | None, base: float | None) -> str:
        return "-" if v is None or not base else f"{v / base:.2f}x"

    out = [f"{'scenario':<12} {'MiB':>4} {'plain P':>8} {'plain P-1':>9} {'death step':>10} {'ratio':>6} "
           f"{'set-up':>7} {'admit':>8} {'ratio':>6} {'set-up':>7}  kills/in-allreduce/admissions"]
    for r in rows:
        out.append(f"{r['scenario']:<12} {r['bytes'] / 2**20:4.0f} {ms(r['plain_s']):>8} {ms(r['plain_minus_one_s']):>9} "
                   f"{ms(r['death_step_s']):>10} {x(r['death_step_s'], r['plain_s']):>6} {ms(r['death_setup_s']):>7} "
                   f"{ms(r['admit_s']):>8} {x(r['admit_s'], r['plain_s']):>6} {ms(r['admit_setup_s']):>7}  "
                   f"{r['kills']}/{r['deaths_in_allreduce']}/{r['admissions']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="loopback,continental")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--elements", default="1M", help="float32 elements of the allreduce and of the state")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rows = [run(s, args.peers, parse_size(args.elements), args.kills, args.timeout) for s in args.scenarios.split(",")]
    print(f"run on {when}, commit {_commit() or '?'}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
