"""One-way bulk throughput of a transport on loopback, and what it costs in CPU: rank 0 sends SIZE bytes
to rank 1 REPS times; each rank reports wall time and its CPU time (all threads, and its child processes:
striping workers), so MB/s per core of the sender and of the receiver can be read off.
Transports alternate (A B A B ...) in one run. A transport may carry options of its section after colons:

    python -m benchmarks.bulk --transports tcp,quic --size 64M --reps 5 --rounds 2
    python -m benchmarks.bulk --transports quic,quic:workers=1 --size 64M
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from erdma_core.cli.bench import human, parse_size
from erdma_core.cli.launcher import free_port


def _rank(size: int, reps: int, out: str) -> None:
    import numpy as np

    import erdma_core

    pg = erdma_core.init()
    buf = np.ones(size, np.uint8)
    pg.barrier()
    wall = cpu = 0.0
    for _ in range(reps):
        t0, c0 = time.perf_counter(), _cpu()
        if pg.rank() == 0:
            pg.send(buf, 1)
        else:
            pg.recv(buf, 0)
        pg.barrier()
        wall += time.perf_counter() - t0
        cpu += _cpu() - c0
    Path(f"{out}.{pg.rank()}").write_text(json.dumps({"wall": wall, "cpu": cpu, "bytes": size * reps}))
    pg.destroy()


def _cpu() -> float:
    """CPU seconds of this process and its live children (a transport's worker processes)."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def measure(spec: str, size: int, reps: int) -> dict[str, float]:
    """``spec``: a transport name, then ``:key=value`` options of its config section."""
    transport, *opts = spec.split(":")
    extra = {f"ERDMA_TRANSPORT_{transport.upper()}_{k.upper()}": v for k, v in (o.split("=", 1) for o in opts)}
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/r"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")} | {
            "ERDMA_TRANSPORT": transport, "ERDMA_TRANSPORT_QUIC_SECRET": os.urandom(8).hex(), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
        env |= extra
        cmd = [sys.executable, "-m", "benchmarks.bulk", "--rank-job", str(size), str(reps), out]
        procs = [subprocess.Popen(cmd, env=env | {"RANK": str(r)}) for r in range(2)]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise SystemExit(f"{transport}: a rank exited {p.returncode}")
        sender, receiver = (json.loads(Path(f"{out}.{r}").read_text()) for r in range(2))
    mb = sender["bytes"] / 1e6
    wall = max(sender["wall"], receiver["wall"])
    return {"MB/s": mb / wall, "sender MB per CPU-s": mb / sender["cpu"], "receiver MB per CPU-s": mb / receiver["cpu"],
            "sender CPU %": 100 * sender["cpu"] / wall, "receiver CPU %": 100 * receiver["cpu"] / wall}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--rank-job"]:
        _rank(int(args[1]), int(args[2]), args[3])
        return 0
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bulk", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default="tcp,quic")
    ap.add_argument("--size", default="64M")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per transport")
    a = ap.parse_args(args)
    size = parse_size(a.size)
    cols = ("MB/s", "sender MB per CPU-s", "receiver MB per CPU-s", "sender CPU %", "receiver CPU %")
    print(f"one-way, {human(size)} x {a.reps} per round, loopback, 2 processes")
    print(f"{'transport':>18} {'round':>5} " + " ".join(f"{c:>22}" for c in cols))
    for rnd in range(a.rounds):
        for t in a.transports.split(","):
            r = measure(t, size, a.reps)
            print(f"{t:>18} {rnd + 1:>5} " + " ".join(f"{r[c]:>22.1f}" for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
