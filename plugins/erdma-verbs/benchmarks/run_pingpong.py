"""How long one message takes there and back in the test guest (SoftRoCE, one rxe device, 2 ranks), for the
C floor and for eRDMA: rdma-core's ``ibv_rc_pingpong`` (RC SEND/receive in C, polling and on completion
events), Open MPI's send/receive over TCP and over shared memory (``pingpong_mpi.c``), and eRDMA's
``ProcessGroup.send``/``recv`` over tcp and verbs (``pingpong_stages.py``; verbs also with the ranks
polling, ``run_alltoall.POLLING``). Needs root, the guest's tools, and mpicc on this host
(``scripts/system-deps.sh bench``). Prints one line per system and a markdown table.

    python benchmarks/run_pingpong.py [--iters 2000] [--bytes 4096]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from erdma_verbs import guest
from run_alltoall import CHECKOUT, HERE, PLUGIN, POLLING  # (this script's folder is on the path: it runs as a script)

# the rxe device's RoCEv2 GID on its IPv4 address (what the transport picks), from ibv_devinfo
GID = "$(ibv_devinfo -v | sed -n 's/.*GID\\[ *\\([0-9]*\\)\\]:.*::ffff:.*RoCE v2/\\1/p' | head -1)"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--bytes", type=int, default=4096)
    args = ap.parse_args()
    n, size = args.iters, args.bytes
    with tempfile.TemporaryDirectory(dir=PLUGIN, prefix=".bench-") as tmp:
        binary = Path(tmp) / "pingpong_mpi"
        subprocess.run(["mpicc", "-O2", "-o", str(binary), str(HERE / "pingpong_mpi.c")], check=True)
        lines = [f"g={GID}"]
        for flag, name in (("", "ibv_rc_pingpong"), ("-e", "ibv_rc_pingpong-events")):
            rc = f"ibv_rc_pingpong {flag} -d rxe0 -g $g -m 4096 -s {size} -n {n}"
            lines += [f"{rc} > /dev/null 2>&1 &", "sleep 2",
                      f"{rc} 127.0.0.1 2>&1 | sed -n 's/.* = \\([0-9.]*\\) usec\\/iter/pingpong system={name} "
                      f"bytes={size} usec=\\1/p'", "wait"]
        mpirun = "mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none --mca pml ob1"
        for name, btl in (("mpi-tcp", "self,tcp --mca btl_tcp_if_include lo"), ("mpi-shm", "self,vader")):
            lines.append(f"{mpirun} --mca btl {btl} {binary} {n} {size} {name}")
        for transport, extra in (("tcp", ""), ("verbs", ""), ("verbs", POLLING)):
            lines.append(f"{sys.executable} {HERE / 'pingpong_stages.py'} {transport} {n // 4} {size} {extra}")
        script = Path(tmp) / "runs.sh"
        script.write_text("\n".join(lines) + "\n")
        rc, out = guest.run(PLUGIN, f"sh tests/guest/run.sh sh {script} 2>&1 | grep -v INFO", timeout=3600,
                            shares=[CHECKOUT, *guest.host_python()])
    print(out)
    rows = re.findall(r"^pingpong system=(\S+) bytes=\d+ usec=([\d.]+)", out, re.M)
    print(f"\n| {size} B there and back, 2 ranks | microseconds per round trip |\n|---|---|")
    for name, usec in rows:
        print(f"| {name} | {usec} |")
    return rc


if __name__ == "__main__":
    sys.exit(main())
