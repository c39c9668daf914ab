"""Redo the seeds' sequential all-to-all experiment in the test guest (SoftRoCE, one rxe device, 3 ranks):
an all-to-all of BYTES per rank pair repeated 100, 1,000 and 10,000 times with eRDMA's ``sequential`` and
``pairwise`` algorithms over ``verbs`` and over ``tcp``, and with Open MPI's ``MPI_Alltoall`` (over its TCP
transport, as between the report's VMs, and over shared memory). Needs root, the guest's tools, and mpicc on
this host (``scripts/system-deps.sh bench``). Prints one line per run and a markdown table.

    python benchmarks/run_alltoall.py [--stages 100,1000,10000] [--bytes 4096]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from erdma_verbs import guest

HERE = Path(__file__).resolve().parent
PLUGIN = HERE.parent
CHECKOUT = PLUGIN.parent.parent
# a waiting rank polls its completion queue, yielding the core, for 20 ms before it sleeps: as Open MPI's
# ranks poll (they yield when the host is oversubscribed, as here); the default (50 us) sleeps sooner
POLLING = "transport.verbs.spin_us=20000"


def _timed(command: str) -> str:
    """A shell line that runs ``command`` and prints what it printed with ``total_ms=``, its whole run (process
    start to exit) as the guest's shell timed it: the same for ``mpirun`` and for eRDMA's Python."""
    return f"s=$(date +%s%N); r=$({command}); e=$(date +%s%N); echo \"$r total_ms=$(( (e - s) / 1000000 ))\""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="100,1000,10000")
    ap.add_argument("--bytes", type=int, default=4096)
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    with tempfile.TemporaryDirectory(dir=PLUGIN, prefix=".bench-") as tmp:
        binary = Path(tmp) / "alltoall_mpi"
        subprocess.run(["mpicc", "-O2", "-o", str(binary), str(HERE / "alltoall_mpi.c")], check=True)
        mpirun = "mpirun --allow-run-as-root --oversubscribe -np 3 --bind-to none"
        lines = []
        for n in stages:
            for name, btl in (("tcp", "self,tcp --mca btl_tcp_if_include lo"), ("shm", "self,vader")):
                lines.append(_timed(f"{mpirun} --mca pml ob1 --mca btl {btl} {binary} {n} {args.bytes}")
                             + f" | sed 's/^mpi /mpi-{name} /'")
            for transport, extra in (("verbs", ""), ("verbs", POLLING), ("tcp", "")):
                for algorithm in ("sequential", "pairwise"):
                    lines.append(_timed(f"{sys.executable} {HERE / 'alltoall_stages.py'} {transport} {algorithm} {n} "
                                        f"{args.bytes} {extra}"))
        script = Path(tmp) / "runs.sh"
        script.write_text("\n".join(lines) + "\n")
        rc, out = guest.run(PLUGIN, f"sh tests/guest/run.sh sh {script} 2>&1 | grep -v INFO", timeout=3 * 3600,
                            shares=[CHECKOUT, *guest.host_python()])
    print(out)
    rows: dict[tuple[str, int], str] = {}
    for m in re.finditer(r"^(mpi-tcp|mpi-shm) stages=(\d+) bytes=\d+ seconds=([\d.]+) total_ms=(\d+)", out, re.M):
        rows[(f"Open MPI MPI_Alltoall ({m[1][4:]})", int(m[2]))] = f"{m[3]} ({int(m[4]) / 1e3:.2f} with set-up)"
    for m in re.finditer(r"^erdma transport=(\w+) algorithm=(\w+) stages=(\d+) bytes=\d+ seconds=([\d.]+) "
                         r"(\w+)(.*) total_ms=(\d+)$", out, re.M):
        how = f", polling ({m[6].strip()})" if m[6].strip() else ""
        rows[(f"eRDMA {m[2]} over {m[1]}{how}", int(m[3]))] = (f"{m[4]} ({int(m[7]) / 1e3:.2f} with set-up)"
                                                             + ("" if m[5] == "ok" else " WRONG"))
    names = list(dict.fromkeys(k[0] for k in rows))
    print(f"\n| {args.bytes} B per pair, 3 ranks | " + " | ".join(f"{n} stages" for n in stages) + " |")
    print("|---|" + "---|" * len(stages))
    for name in names:
        print(f"| {name} | " + " | ".join(rows.get((name, n), "-") for n in stages) + " |")
    return rc


if __name__ == "__main__":
    sys.exit(main())
