"""The collective benchmark behind ``erdma bench``: an nccl-tests style table, every result validated.

Run as every rank of a job (``erdma run -n 4 -- python -m erdma_core.cli.bench``, or ``erdma bench -n 4``).
``--compare gloo`` times torch.distributed's Gloo on the same ranks in the same run, so the table's ratio
compares like with like.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..protocol.ops import BENCHMARKED, OPS
from .bench_backends import Erdma, Gloo, Mpi

BUS_FACTOR: dict[str, Callable[[int], float]] = BENCHMARKED
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def human(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def _hivemind(algorithm: str | None) -> Any:
    from .bench_hivemind import Hivemind  # imported only when selected

    return Hivemind(algorithm)


BACKENDS: dict[str, Callable[[str | None], Any]] = {"erdma": Erdma, "gloo": Gloo, "mpi": Mpi, "hivemind": _hivemind}


def _values(rank: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Rank ``rank``'s data, random (any rank can make any other's): eighths in [-1000, 1000] (integers for an
    integer dtype), whose sums over the ranks are exact in every dtype offered, so a result is checked exactly,
    and which a lossy compressor does not carry exactly (constants it would), so its error shows."""
    values = np.random.default_rng([rank, count]).integers(-8000, 8001, count)
    return (values if dtype.kind in "iu" else values / 8).astype(dtype)


def _buffers(op: str, count: int, rank: int, p: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, Any]:
    """(template for out, input, expected out) for ``op`` on random data (``_values``)."""
    if op == "allreduce":
        return _values(rank, count, dtype), np.empty(0, dtype), sum(_values(r, count, dtype) for r in range(p))
    if op == "broadcast":  # from rank 0
        return _values(rank, count, dtype), np.empty(0, dtype), _values(0, count, dtype)
    if op == "allgather":
        return np.zeros(count * p, dtype), _values(rank, count, dtype), \
            np.concatenate([_values(r, count, dtype) for r in range(p)])
    if op == "reduce_scatter":
        mine = slice(rank * count, (rank + 1) * count)
        return np.zeros(count, dtype), _values(rank, count * p, dtype), \
            sum(_values(r, count * p, dtype)[mine] for r in range(p))
    if op == "alltoall":
        per = max(1, count // p)
        mine = slice(rank * per, (rank + 1) * per)  # block j of the output is block ``rank`` of rank j's input
        return np.zeros(per * p, dtype), _values(rank, per * p, dtype), \
            np.concatenate([_values(r, per * p, dtype)[mine] for r in range(p)])
    raise ValueError(f"--op {op!r}; valid choices: {', '.join(BUS_FACTOR)}")


def _predict(rows: list[dict[str, Any]], nbytes: int) -> float:
    """Seconds one op of ``nbytes`` should take: latency + size/bandwidth fitted through the last two sizes
    (with one size, assume it was all latency; a lower bound)."""
    t2, n2 = rows[-1]["time_us"] * 1e-6, rows[-1]["size"]
    if len(rows) < 2:
        return t2
    t1, n1 = rows[-2]["time_us"] * 1e-6, rows[-2]["size"]
    per_byte = max(0.0, (t2 - t1) / (n2 - n1)) if n2 != n1 else 0.0
    return t2 + per_byte * (nbytes - n2)


SMALL = 64 << 10  # sizes up to this take ``small_iters`` iterations: their times are short and noisy
SMALL_WARMUP = 200  # untimed iterations before them, by default (``--small-warmup``)


def bench(backend: Any, op: str, sizes: list[int], dtype: np.dtype, iters: int, warmup: int,
          max_seconds: float | None = None, small_iters: int | None = None, rtol: float = 0.0,
          small_warmup: int | None = None) -> list[dict[str, Any]]:
    """Time ``op`` at each size (``small_iters`` iterations up to 64 KiB when given, like OSU's
    micro-benchmarks, else ``iters``); with ``max_seconds``, stop before a size whose loop would take
    longer than that, predicted from the sizes before (from the max over ranks: every rank stops alike).
    Data are random (``_values``). An element is wrong when it differs from its expected value (by more than
    ``rtol`` times the largest expected value); ``max_err`` is the largest such difference, relative."""
    rows: list[dict[str, Any]] = []
    p = backend.size
    shown = 0.0
    # progress (on stderr) only when the output is a terminal too: `erdma bench | cat` shows the table alone
    live = backend.rank == 0 and sys.stderr.isatty() and sys.stdout.isatty()
    for nbytes in sizes:
        n_iters = small_iters if small_iters and nbytes <= SMALL else iters
        n_warm = small_warmup if small_warmup is not None and nbytes <= SMALL else warmup
        if max_seconds is not None and rows and _predict(rows, nbytes) * (n_warm + n_iters) > max_seconds:
            break
        count = max(1, nbytes // dtype.itemsize)
        template, inp, expected = _buffers(op, count, backend.rank, p, dtype)
        out = template.copy()
        t_out, t_in = backend.wrap(out), backend.wrap(inp)
        scale = float(np.max(np.abs(expected.astype(np.float64)))) or 1.0
        wrong, elapsed, cpu, err = 0, 0.0, 0.0, 0.0
        for i in range(n_warm + n_iters):
            np.copyto(out, template)
            cpu_start, start = time.process_time(), time.perf_counter()
            backend.op(op, t_out, t_in)
            took, cpu_took = time.perf_counter() - start, time.process_time() - cpu_start  # every thread's CPU
            if not np.array_equal(out, expected):
                off = np.abs(out.astype(np.float64) - expected)
                err = max(err, float(off.max()) / scale)
                wrong += int(np.count_nonzero(off > rtol * scale))
            if i >= n_warm:
                elapsed += took
                cpu += cpu_took
            if live and time.perf_counter() - shown > 0.5:  # now and then: a write skews the ranks
                shown = time.perf_counter()
                sys.stderr.write(f"\r[bench] {backend.name} {op} {human(nbytes)} {i + 1}/{n_warm + n_iters}   ")
                sys.stderr.flush()
        t = backend.max_over_ranks(elapsed / n_iters)
        algbw = count * dtype.itemsize / t / 1e9
        cpu_per_gb = backend.sum_over_ranks(cpu) / (count * dtype.itemsize * n_iters / 1e9)
        rows.append({"backend": backend.name, "size": count * dtype.itemsize, "count": count, "dtype": dtype.name,
                     "op": op, "time_us": t * 1e6, "algbw": algbw, "busbw": algbw * BUS_FACTOR[op](p),
                     "wrong": int(backend.max_over_ranks(wrong)), "ranks": p,
                     "max_err": float(backend.max_over_ranks(err)),  # largest |error| / largest |expected value|
                     "cpu_s_per_gb": cpu_per_gb,  # CPU seconds of all ranks per GB of the op's buffer
                     "setup": backend.describe(op) if hasattr(backend, "describe") else ""})
    if live:
        sys.stderr.write("\r" + " " * 60 + "\r")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """nccl-tests' table: size in bytes, element count, dtype, op and reduce op, time per op in
    microseconds (slowest rank), algorithm and bus bandwidth in GB/s, wrong elements (0: every result checked),
    then the largest error relative to the largest expected value (a lossy compressor's; 0 when exact)."""
    head = f"# {'size(B)':>12} {'count':>12} {'type':>8} {'op':>14} {'redop':>6} {'time(us)':>10} " \
           f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7} {'maxerr':>8}"
    setup = f"  {rows[0]['setup']}" if rows and rows[0].get("setup") else ""
    lines = [f"# backend: {rows[0]['backend']}  ranks: {rows[0]['ranks']}{setup}", head] if rows else []
    for r in rows:
        redop = "sum" if OPS[r["op"]].reduces else "-"
        lines.append(f"  {r['size']:>12} {r['count']:>12} {r['dtype']:>8} {r['op']:>14} {redop:>6} "
                     f"{r['time_us']:>10.1f} {r['algbw']:>12.3f} {r['busbw']:>12.3f} {r['wrong']:>7} "
                     f"{r.get('max_err', 0.0):>8.2g}")
    return "\n".join(lines)


def ratios(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> str:
    lines = [f"# busbw (GB/s) of erdma and {peer[0]['backend']}, and their ratio (same run, same ranks)",
             f"  {'size':>12} {'erdma':>10} {peer[0]['backend']:>10} {'ratio':>8}"]
    for a, b in zip(ours, peer, strict=True):
        lines.append(f"  {human(a['size']):>12} {a['busbw']:>10.3f} {b['busbw']:>10.3f} {a['busbw'] / b['busbw']:>8.2f}")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``python -m erdma_core.cli.bench`` and ``erdma bench``)."""
    ap.add_argument("--op", default="allreduce", choices=sorted(BUS_FACTOR), help="collective to time")
    ap.add_argument("--sizes", default="4K,1M,64M", help="comma list of message sizes in bytes, e.g. 4K,1M,64M")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "int32", "int64"])
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    ap.add_argument("--small-iters", type=int, default=None,
                    help="timed iterations for sizes up to 64 KiB (default: --iters)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations before them")
    ap.add_argument("--small-warmup", type=int, default=SMALL_WARMUP,
                    help=f"untimed iterations before sizes up to 64 KiB (default {SMALL_WARMUP}, as OSU's "
                         "micro-benchmarks skip there): with more busy ranks than cores, the host's scheduler takes "
                         "tens of milliseconds to settle, which is hundreds of small collectives")
    ap.add_argument("--algorithm", default=None, help="erdma algorithm (default: the config's choice)")
    ap.add_argument("--backend", choices=sorted(BACKENDS), default="erdma",
                    help="the system to time (mpi: start the ranks with mpirun; hivemind: pip install hivemind, "
                         "allreduce only)")
    ap.add_argument("--compare", choices=["gloo"], default=None,
                    help="also time torch.distributed's Gloo in the same run (needs torch: "
                         "pip install 'erdma-core[torch]')")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="skip the remaining (larger) sizes once one's loop is predicted to take longer than this")
    ap.add_argument("--rtol", type=float, default=None,
                    help="count an element wrong only when it is further than RTOL x the largest |expected value| "
                         "from its expected value (default: exact; a lossy compressor needs its error bound)")
    ap.add_argument("--json", default=None, help="write all rows to this file (rank 0)")


def forwarded(args: argparse.Namespace) -> list[str]:
    """``args`` (parsed by ``add_arguments``) as the command line of the benchmark ranks."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    out = []
    for action in ap._actions:
        if action.dest == "help" or getattr(args, action.dest) is None:
            continue
        out += [action.option_strings[-1], str(getattr(args, action.dest))]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m erdma_core.cli.bench", description=__doc__)
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.compare and args.backend != "erdma":
        ap.error(f"--compare {args.compare} needs --backend erdma, got --backend {args.backend}")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    dtype = np.dtype(args.dtype)
    results = []
    for cls in [BACKENDS[args.backend]] + ([Gloo] if args.compare == "gloo" else []):
        backend = cls(args.algorithm)
        rows = bench(backend, args.op, sizes, dtype, args.iters, args.warmup, args.max_seconds, args.small_iters,
                     args.rtol or 0.0, args.small_warmup)
        if backend.rank == 0:
            print(table(rows), flush=True)
        results.append(rows)
        if isinstance(backend, Erdma) and args.compare:  # rank 0 picks a free port for the peer's store
            from .launcher import free_port

            port = np.array([free_port() if backend.rank == 0 else 0], np.int64)
            backend.pg.broadcast(port, 0)
            os.environ["MASTER_PORT"] = str(int(port[0]))
        backend.close()
    if len(results) == 2 and results[0] and backend.rank == 0:
        print(ratios(results[0], results[1]), flush=True)
    if args.json and backend.rank == 0:
        with open(args.json, "w") as f:
            json.dump([r for rows in results for r in rows], f, indent=1)
    wrong = sum(r["wrong"] for rows in results for r in rows)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
