"""Where a small collective's time goes: 2 ranks on loopback run N blocking 4 KiB allreduces (``--op`` for
another collective); each rank reports wall time, user and system CPU and context switches per op; rank 0
splits its wall time per op by phase with no profiler (``phases.py``: API, posting receives, sending, waiting
for peers' data, reducing, the rest); and rank 0's cProfile of its own thread's CPU time (a blocking
collective runs there) gives each layer's share of it and lists the functions with the most time of their
own. ``--transport quic`` runs the same over erdma-quic,
driven the same way (by the waiting thread): the core's layers should cost the same per op on both.

    python -m benchmarks.profile_small --iters 3000 --ranks 2 --size 4K [--op alltoall] [--transport quic]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from erdma_core.cli.bench import parse_size

from .phases import Timeline


def _collective(pg: Any, op: str, size: int) -> Callable[[], object]:
    """One blocking call of ``op`` on ``size`` bytes of float32 per rank (alltoall: the whole buffer)."""
    import numpy as np

    a = np.ones(size // 4, np.float32)
    if op == "allreduce":
        return lambda: pg.allreduce(a)
    if op == "broadcast":
        return lambda: pg.broadcast(a, 0)
    if op == "allgather":
        out = np.empty(a.size * pg.size(), np.float32)
        return lambda: pg.allgather(out, a)
    if op == "reduce_scatter":
        big, out = np.ones(a.size * pg.size(), np.float32), np.empty(a.size, np.float32)
        return lambda: pg.reduce_scatter(out, big)
    out = np.empty_like(a)
    return lambda: pg.alltoall(out, a)


def _rank(op: str, iters: int, size: int, top: int) -> None:
    import erdma_core

    pg = erdma_core.init()
    call = _collective(pg, op, size)
    for _ in range(200):
        call()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(iters):
        call()
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    line = (f"rank {pg.rank()}: {(t1 - t0) / iters * 1e6:.0f} us per {op}; CPU per op: user "
            f"{(r1.ru_utime - r0.ru_utime) / iters * 1e6:.0f} us, system {(r1.ru_stime - r0.ru_stime) / iters * 1e6:.0f} "
            f"us; context switches per op: {(r1.ru_nvcsw - r0.ru_nvcsw) / iters:.2f} voluntary, "
            f"{(r1.ru_nivcsw - r0.ru_nivcsw) / iters:.2f} involuntary")
    pg.barrier()
    timeline = Timeline(pg.transport)
    for _ in range(iters):
        timeline.call(call)
    timeline.restore()
    pg.barrier()
    prof = cProfile.Profile(time.thread_time)  # CPU time of this thread: waiting for the GIL or a peer is not charged
    if pg.rank() == 0:
        prof.enable()
    for _ in range(iters):
        call()
    if pg.rank() == 0:
        prof.disable()
    pg.barrier()
    counted = _bytecodes(call, min(iters, 300), trace=pg.rank() == 0)  # every rank runs the ops
    pg.barrier()
    time.sleep(0.2 * pg.rank())
    print(line, flush=True)
    if counted:
        print(counted, flush=True)
    if pg.rank() == 0:
        print(timeline.report())
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        body = out.getvalue()
        print("rank 0 under cProfile, counting its thread's CPU time (the profiler slows every Python call, so the shares "
              "matter more than the times):")
        print(layers(stats, iters))
        print(body[body.index("ncalls"):].rstrip(), flush=True)
    pg.destroy()


def _bytecodes(call: Callable[[], object], n: int, trace: bool) -> str:
    """Python bytecodes this thread executes per op, and Python-level calls, by layer (``sys.settrace``
    opcode events over ``n`` ops): what the interpreter works through, whatever the host's speed. Without
    ``trace`` it only runs the ops (the peers of the rank that counts)."""
    if not trace:
        for _ in range(n):
            call()
        return ""
    ops: dict[str, int] = {}
    calls: dict[str, int] = {}

    def tracer(frame: Any, event: str, arg: object) -> Any:
        where = frame.f_code.co_filename
        if event == "call":
            frame.f_trace_opcodes = True
            calls[where] = calls.get(where, 0) + 1
        elif event == "opcode":
            ops[where] = ops.get(where, 0) + 1
        return tracer

    sys.settrace(tracer)
    try:
        for _ in range(n):
            call()
    finally:
        sys.settrace(None)
    by_layer: dict[str, list[int]] = {}
    for where in set(ops) | set(calls):
        row = by_layer.setdefault(_layer(where), [0, 0])
        row[0] += ops.get(where, 0)
        row[1] += calls.get(where, 0)
    total = [sum(r[0] for r in by_layer.values()), sum(r[1] for r in by_layer.values())]
    rows = [f"  {name:<64} {b / n:8.0f} {c / n:8.1f}" for name, (b, c) in sorted(by_layer.items(), key=lambda kv: -kv[1][0])]
    return (f"rank 0, Python bytecodes and Python-level calls per op ({n} ops traced; built-ins run no bytecode):\n"
            f"  {'layer':<64} {'bytecode':>8} {'calls':>8}\n" + "\n".join(rows)
            + f"\n  {'all':<64} {total[0] / n:8.0f} {total[1] / n:8.1f}")


OPS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")
LAYERS = (  # (name, path fragments of its modules), first match wins
    ("API and engine (erdma_core/api, engine, algorithms)", ("erdma_core/api/", "erdma_core/engine/",
                                                            "erdma_core/algorithms/")),
    ("matching and framing (transport/base, mailbox, frames, wire)", ("erdma_core/transport/",)),
    ("erdma-quic", ("erdma_quic/",)),
    ("aioquic (QUIC itself)", ("aioquic/",)),
    ("system calls, numpy, locks (built-ins)", ("~",)),
)
_SOCKETS = ("progress.py", "stream.py", "tcp.py", "sockets.py")


def _layer(filename: str) -> str:
    if "erdma_core/transport/" in filename and filename.endswith(_SOCKETS):
        return "socket driving (transport/progress, stream, tcp)"
    return next((n for n, parts in LAYERS if any(p in filename for p in parts)), "other Python (threading, queues, ...)")


def layers(stats: pstats.Stats, iters: int) -> str:
    """Own time per op of each layer: the core's (API, engine, matching) apart from the transport's."""
    totals: dict[str, float] = {}
    for (filename, _, _), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        name = _layer(filename)
        totals[name] = totals.get(name, 0.0) + own
    whole = sum(totals.values()) or 1.0
    rows = [f"  {name:<64} {t / iters * 1e6:8.1f} us/op {t / whole:6.1%}"
            for name, t in sorted(totals.items(), key=lambda kv: -kv[1])]
    return "own time by layer, per op:\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_small", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--op", choices=OPS, default="allreduce")
    ap.add_argument("--size", default="4K")
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--transport", choices=["tcp", "quic"], default="tcp")
    ap.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_job:
        _rank(args.op, args.iters, parse_size(args.size), args.top)
        return 0
    cmd = [sys.executable, "-m", "erdma_core.cli", "run", "-n", str(args.ranks), "--no-prefix", "--",
           sys.executable, "-m", "benchmarks.profile_small", "--rank-job", "--op", args.op, "--iters", str(args.iters),
           "--size", args.size, "--top", str(args.top)]
    print(f"python -m benchmarks.profile_small --op {args.op} --ranks {args.ranks} --size {args.size} --iters {args.iters} "
          f"--transport {args.transport}")
    env = dict(os.environ)
    if args.transport == "quic":
        from .launch import SYSTEMS

        env |= SYSTEMS["erdma-quic"][1]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    print(r.stdout.rstrip())
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
