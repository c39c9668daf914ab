"""Two builds of eRDMA, one run: each build's ``erdma bench`` on loopback, alternated round by round, and the
median time per size with the ratio B/A (above 1: B is slower).

    python -m benchmarks.ab --a before=/tmp/before-venv/bin/python --b after=.venv/bin/python \\
        --ranks 2,4 --sizes 4K,64K,1M,64M --rounds 3 [--env ERDMA_TRANSPORT_TCP_LOCAL_SOCKETS=false]

Each interpreter must have its build of erdma-core installed; its bench module is found by name (the
command line's, or the older top-level one). ``ERDMA_*`` variables of this shell are not passed on; ``--env``
sets one for both builds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from erdma_core.cli.bench import human, parse_size


def _bench_module(python: str) -> str:
    for module in ("erdma_core.cli.bench", "erdma_core.bench"):
        found = subprocess.run([python, "-c", f"import {module}"], capture_output=True, cwd=tempfile.gettempdir())
        if found.returncode == 0:
            return module
    raise SystemExit(f"{python}: no erdma bench module")


def _launcher(python: str) -> list[str]:
    for module in ("erdma_core.cli", "erdma_core.cli.main"):
        found = subprocess.run([python, "-m", module, "run", "--help"], capture_output=True,
                               cwd=tempfile.gettempdir())
        if found.returncode == 0:
            return [python, "-m", module]
    raise SystemExit(f"{python}: no erdma command line")


def run_once(python: str, ranks: int, args: list[str], extra: dict[str, str]) -> list[dict[str, object]]:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")} | extra
    cmd = [*_launcher(python), "run", "-n", str(ranks), "--no-prefix", "--", python, "-m", _bench_module(python),
           *args, "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    rows = json.loads(out.read_text())
    out.unlink()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="label=python of the reference build")
    ap.add_argument("--b", required=True, help="label=python of the build compared with it")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sizes", default="4K,64K,1M,64M")
    ap.add_argument("--op", default="allreduce")
    ap.add_argument("--rounds", type=int, default=3, help="alternations A, B per rank count")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable both builds' ranks get (repeatable)")
    args = ap.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.env)
    builds = [tuple(x.split("=", 1)) for x in (args.a, args.b)]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    bench_args = ["--op", args.op, "--sizes", args.sizes, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    times: dict[tuple[str, int, int], list[float]] = {}
    for ranks in (int(r) for r in args.ranks.split(",")):
        for rnd in range(args.rounds):
            order = builds if rnd % 2 == 0 else builds[::-1]
            for label, python in order:
                for row in run_once(python, ranks, bench_args, extra):
                    times.setdefault((label, ranks, int(row["size"])), []).append(float(row["time_us"]))  # type: ignore[arg-type]
                sys.stderr.write(f"[ab] ranks {ranks} round {rnd + 1}/{args.rounds} {label} done\n")
    (la, _), (lb, _) = builds
    print(f"# {args.op}, loopback, median time per op in us over {args.rounds} runs of {args.iters} iterations "
          f"each (each run's time: the slowest rank's); ratio = {lb} / {la} (above 1: {lb} slower)"
          + "".join(f"; {item}" for item in args.env))
    print(f"{'ranks':>5} {'size':>6} {la:>12} {lb:>12} {'ratio':>7}")
    for ranks in (int(r) for r in args.ranks.split(",")):
        for size in sizes:
            a = statistics.median(times[(la, ranks, size)])
            b = statistics.median(times[(lb, ranks, size)])
            print(f"{ranks:>5} {human(size):>6} {a:>12.1f} {b:>12.1f} {b / a:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
