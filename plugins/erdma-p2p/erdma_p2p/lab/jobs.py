"""``job`` (``python -m erdma_p2p.lab.job``) on every site's host of a ``NatLab``, with the environment of a job
that traverses the bed's NATs (``RELAY``: coturn as the TURN relay too), and the results it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .natlab import STUN, STUN_CHECK, TURN_PASSWORD, TURN_USER, NatLab

CONNECT_S = 30.0  # timeouts.connect of the jobs that are to connect: counted from a rank's own publishing, so
# it also covers a peer that starts late (under CI's load one rank's start ran more than 6 s behind the other's)
UNREACHABLE_S = 6.0  # timeouts.connect of the jobs whose pairs are not to meet: each waits it out in full

RELAY = {"ERDMA_TRAVERSAL": "stun", "ERDMA_TRAVERSAL_STUN_RELAY": f"{STUN[0]}:{STUN[1]}",
         "ERDMA_TRAVERSAL_STUN_RELAY_USER": TURN_USER, "ERDMA_TRAVERSAL_STUN_RELAY_PASSWORD": TURN_PASSWORD,
         "ERDMA_TRAVERSAL_STUN_CHECK_SERVER": f"{STUN_CHECK[0]}:{STUN_CHECK[1]}"}
TURN_HOSTS = (STUN[0], STUN_CHECK[0])  # coturn relays from either of its addresses


def wait_started(tmp: Path, ranks: int, timeout: float = CONNECT_S + 60) -> list[dict[str, str]]:
    """Wait until ``ranks`` ranks of the job ``run_job(lab, tmp, ...)`` runs have finished their first allreduce
    (connected to their peers): each one's paths to its peers ("direct" or "relayed", by peer), by rank. A
    test that breaks something mid-job calls it from ``during`` instead of sleeping for a while: under load a
    rank's start can take longer than any fixed wait. RuntimeError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = sorted((f for f in (tmp / "started").iterdir() if f.name.isdigit()), key=lambda f: int(f.name))
        if len(found) >= ranks:
            return [json.loads(f.read_text()) for f in found]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(found)} of {ranks} ranks finished a first allreduce within {timeout:.0f}s")
        time.sleep(0.05)


def run_job(lab: NatLab, tmp: Path, iters: int = 20, count: int = 50000, during: Callable[[], None] | None = None,
            **env: str) -> list[dict]:
    """Run job.py on every site's host; ``during()`` runs while the ranks do (and may break things)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_") or k == "ERDMA_TRANSPORT_QUIC_ENGINE"}
    (tmp / "started").mkdir(exist_ok=True)
    base |= {"WORLD_SIZE": str(lab.sites), "ERDMA_INIT_METHOD": f"file://{tmp}/store", "ERDMA_TRANSPORT": "quic",
             "JOB_STARTED": str(tmp / "started"),
             "ERDMA_SECRET": "nat-test", "ERDMA_TRAVERSAL_STUN_SERVER": f"{STUN[0]}:{STUN[1]}",
             "ERDMA_TIMEOUTS_CONNECT": str(CONNECT_S), **env}
    procs = [subprocess.Popen(["ip", "netns", "exec", lab.host(i), sys.executable, "-m", "erdma_p2p.lab.job", str(iters),
                               str(count)],
                              env=base | {"RANK": str(i)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(lab.sites)]
    if during is not None:
        during()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=CONNECT_S + 60)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if not lines and p.returncode == 3:  # told to exit (JOB_EXIT)
            lines = ['{"exited": true}']
        if not lines:
            raise RuntimeError(f"a rank printed no result; its stderr ends: {stderr[-2000:]}")
        out.append(json.loads(lines[-1]) | {"stderr": stderr[-4000:]})
    return out
