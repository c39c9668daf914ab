"""How much the emulator itself carries on this machine: TCP bulk throughput through the relay with no rate
limit, one flow and two concurrent flows, at 0 and 40 ms RTT. No lab result may be quoted above this.

    python -m benchmarks.ceiling [--seconds 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.netlab.topology import Lab, LinkSpec

ROOT = Path(__file__).resolve().parents[1]
PROBE = [sys.executable, "-m", "benchmarks.netlab.probe"]


def flows(lab: Lab, pairs: list[tuple[int, int]], seconds: float) -> list[dict[str, Any]]:
    sinks = []
    for k, (_, dst) in enumerate(pairs):
        s = lab.popen(dst, [*PROBE, "sink", "--port", str(9100 + k)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert s.stdout is not None and s.stdout.readline().strip() == "ready"
        sinks.append(s)
    senders = [lab.popen(src, [*PROBE, "send", "--host", lab.addr(dst), "--port", str(9100 + k), "--seconds",
                               str(seconds)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
               for k, (src, dst) in enumerate(pairs)]
    results = [json.loads(p.communicate(timeout=seconds + 60)[0]) for p in senders]
    for s in sinks:
        s.wait(timeout=30)
    return results


def measure(seconds: float) -> list[dict[str, Any]]:
    rows = []
    for rtt in (0.0, 40.0):
        with Lab(2, LinkSpec(rtt_ms=rtt)) as lab:
            one = flows(lab, [(0, 1)], seconds)
        with Lab(4, LinkSpec(rtt_ms=rtt)) as lab:
            two = flows(lab, [(0, 1), (2, 3)], seconds)
        rows.append({"rtt_ms": rtt, "one_flow_mbit_s": one[0]["mbit_s"],
                     "two_flows_mbit_s": sum(r["mbit_s"] for r in two), "cc": one[0]["congestion_control"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ceiling", description=__doc__)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = measure(args.seconds)
    print(f"{'RTT (ms)':>9} {'1 flow (Mbit/s)':>16} {'2 flows (Mbit/s)':>17}  (TCP {rows[0]['cc']}, no rate limit)")
    for r in rows:
        print(f"{r['rtt_ms']:>9.0f} {r['one_flow_mbit_s']:>16.0f} {r['two_flows_mbit_s']:>17.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
