"""The benchmark lab: eRDMA, torch.distributed Gloo and Open MPI, same collectives, sizes and ranks, on
loopback or through an emulated wide-area link, A/B alternated, medians and ratios reported.

    python -m benchmarks.run --scenarios lan,lossy --ranks 2,4 --ops allreduce --sizes 4K,1M,64M \\
        --cc bbr,cubic --repeats 3 --out bench-results/x

Writes ``results.json`` (every job's rows, medians, ratios, the link spec), ``report.md`` (nccl-tests
tables with ratio columns) and ``plots/*.png`` (busbw against size, one line per system) under ``--out``.
Needs root (namespaces); see ``make bench``, which also installs Open MPI, iperf3 and the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from benchmarks import report
from benchmarks.launch import SYSTEMS, JobFailed, run_job
from benchmarks.netlab.topology import Lab, remove_stale
from benchmarks.scenarios import SCENARIOS, scenario
from erdma_core.cli.bench import BUS_FACTOR
from erdma_core.net import congestion


def _list(text: str, valid: Any, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in valid]
    if bad:
        raise SystemExit(f"--{what} {','.join(bad)}: valid choices are {', '.join(valid)}")
    return items


def run_cell(systems: list[str], n: int, op: str, sizes: str, iters: int, warmup: int, repeats: int,
             max_seconds: float, lab: Lab | None, log: Any, job_timeout: float = 900.0,
             baseline: str = "erdma", small_iters: int | None = None,
             small_warmup: int | None = None) -> dict[str, Any]:
    """All systems on one (link, ranks, op), alternating: repeat r starts with system r mod len(systems)."""
    args = ["--op", op, "--sizes", sizes, "--iters", str(iters), "--warmup", str(warmup),
            "--max-seconds", str(max_seconds)] + (["--small-iters", str(small_iters)] if small_iters else []) \
        + (["--small-warmup", str(small_warmup)] if small_warmup is not None else [])
    jobs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in systems}
    failures: dict[str, str] = {}
    for rep in range(repeats):
        order = systems[rep % len(systems):] + systems[:rep % len(systems)]
        for system in order:
            if system in failures:
                continue
            t0 = time.monotonic()
            try:
                try:
                    rows = run_job(system, n, args, lab, timeout=job_timeout)
                except JobFailed as exc:  # one retry: a launch can hang (seen once: an orted never started)
                    log(f"    {system:>10} repeat {rep + 1}: {exc}; retrying once")
                    rows = run_job(system, n, args, lab, timeout=job_timeout)
                jobs[system].append(rows)
                log(f"    {system:>10} repeat {rep + 1}/{repeats}: {time.monotonic() - t0:.1f}s")
            except JobFailed as exc:
                failures[system] = str(exc)
                log(f"    {system:>10} FAILED: {exc}")
    medians = {s: report.median_rows(j) for s, j in jobs.items() if j}
    return {"jobs": jobs, "medians": medians, "ratios": report.ratios(medians, baseline), "failures": failures,
            "baseline": baseline}


def _commit() -> str | None:
    """The checkout's commit (``-dirty`` with uncommitted changes to tracked files); None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="loopback,lan", help=f"comma list of {', '.join(SCENARIOS)}")
    ap.add_argument("--systems", default="erdma,gloo,mpi", help=f"comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--baseline", default="erdma", help="the system every ratio divides by (e.g. erdma-quic)")
    ap.add_argument("--ops", default="allreduce", help=f"comma list of {', '.join(BUS_FACTOR)}")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--cc", default="bbr", help="TCP congestion control in the ranks' namespaces: bbr,cubic,reno")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--small-iters", type=int, default=None, help="iterations for sizes up to 64 KiB (default: --iters)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--small-warmup", type=int, default=None,
                    help="untimed iterations before sizes up to 64 KiB (default: erdma bench's, 200, as OSU skips)")
    ap.add_argument("--repeats", type=int, default=3, help="jobs per system, alternated")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="per size and job: skip larger sizes beyond it")
    ap.add_argument("--job-timeout", type=float, default=900.0, help="seconds one job may take before it fails")
    ap.add_argument("--out", default=None, help="results folder (default bench-results/<time>)")
    args = ap.parse_args(argv)
    scenarios = _list(args.scenarios, SCENARIOS, "scenarios")
    systems = _list(args.systems, SYSTEMS, "systems")
    if args.baseline not in systems:
        raise SystemExit(f"--baseline {args.baseline}: not among --systems {','.join(systems)}")
    ops = _list(args.ops, BUS_FACTOR, "ops")
    ccs = _list(args.cc, ("bbr", "cubic", "reno"), "cc")
    ranks = [int(r) for r in args.ranks.split(",")]
    out = Path(args.out or f"bench-results/{time.strftime('%Y%m%d-%H%M%S')}")
    (out / "plots").mkdir(parents=True, exist_ok=True)
    remove_stale()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    cells: list[dict[str, Any]] = []
    md = [f"Command: `python -m benchmarks.run {' '.join(argv if argv is not None else sys.argv[1:])}`", ""]
    for name in scenarios:
        for cc in ccs if SCENARIOS[name] is not None else [_host_cc()]:
            spec = scenario(name, cc)
            for n in ranks:
                host_port = "mpi" in systems or any(s.startswith("erdma-naca") for s in systems)
                ctx = Lab(n, spec, host_port=host_port) if spec else contextlib.nullcontext()
                with ctx as lab:
                    for op in ops:
                        title = f"{name} ({cc}), {n} ranks, {op}"
                        log(f"== {title}")
                        cell = run_cell(systems, n, op, args.sizes, args.iters, args.warmup, args.repeats,
                                        args.max_seconds, lab, log, args.job_timeout, args.baseline,
                                        args.small_iters, args.small_warmup)
                        cell |= {"scenario": name, "cc": cc, "ranks": n, "op": op,
                                 "link": attrs.asdict(spec) if spec else None,
                                 "relay": lab.relay_counters() if lab else None}
                        cells.append(cell)
                        md.append(report.table(title, cell["medians"], args.baseline))
                        md += [f"- {s} failed: {why}" for s, why in cell["failures"].items()]
                        png = out / "plots" / f"{name}-{cc}-{n}-{op}.png"
                        drawn = report.plot(png, title, cell["medians"])
                        md += ["", f"![{title}](plots/{png.name})" if drawn else
                               "(no plot: matplotlib is not installed; pip install 'erdma-core[bench]')", ""]
                        print(md[-4] if not cell["failures"] else "\n".join(md[-5:]), flush=True)
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv, "commit": _commit()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    (out / "report.md").write_text("\n".join(md) + "\n")
    log(f"wrote {out}/results.json, report.md, plots/")
    wrong = sum(r["wrong"] for c in cells for rows in c["medians"].values() for r in rows)
    failed = sum(len(c["failures"]) for c in cells)
    if failed:
        log(f"{failed} job(s) failed; report.md lists them")
    return 1 if wrong else 2 if failed else 0


def _host_cc() -> str:
    return congestion.host_default()


if __name__ == "__main__":
    sys.exit(main())
