"""allreduce over ``verbs`` (SoftRoCE) and over ``tcp`` in the same test guest, 64 KiB to 64 MiB, with
``erdma bench`` (every result checked): over tcp, over verbs (the compiled path, the default) and over verbs'
message path (``native = false``), alternating, ROUNDS times; the table gives each one's median time and
their ratios to tcp. Needs root and the guest's tools.

    python benchmarks/run_allreduce.py [--ranks 2] [--rounds 2] [--sizes 64K,256K,1M,4M,16M,64M] [--iters 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from erdma_verbs import guest

HERE = Path(__file__).resolve().parent
PLUGIN = HERE.parent
CHECKOUT = PLUGIN.parent.parent
SYSTEMS = {"tcp": '[transport]\nname = "tcp"\n', "verbs": '[transport]\nname = "verbs"\n',
           "verbs-message": '[transport]\nname = "verbs"\n\n[transport.verbs]\nnative = false\n'}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    erdma = Path(sys.executable).with_name("erdma")
    with tempfile.TemporaryDirectory(dir=PLUGIN, prefix=".bench-") as tmp:
        lines = []
        writable = f"/mnt/host/{Path(tmp).name}"  # the guest's writable view of this folder (the checkout is read-only)
        for transport, config in SYSTEMS.items():
            (Path(tmp) / f"{transport}.toml").write_text(config)
        for r in range(args.rounds):
            for transport in SYSTEMS:
                lines.append(f"{erdma} bench -n {args.ranks} --config {tmp}/{transport}.toml --op allreduce "
                             f"--sizes {args.sizes} --iters {args.iters} --small-warmup 20 "
                             f"--json {writable}/{transport}-{r}.json > /dev/null")
        (Path(tmp) / "runs.sh").write_text("set -e\n" + "\n".join(lines) + "\n")
        rc, out = guest.run(PLUGIN, f"sh tests/guest/run.sh sh {tmp}/runs.sh", timeout=3 * 3600,
                            shares=[CHECKOUT, *guest.host_python()])
        if rc:
            print(out)
            return rc
        times: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for transport in SYSTEMS:
                for row in json.loads((Path(tmp) / f"{transport}-{r}.json").read_text()):
                    assert row["wrong"] == 0, row
                    times.setdefault((transport, row["size"]), []).append(row["time_us"])
    sizes = sorted({s for _, s in times})
    print(f"| allreduce, {args.ranks} ranks, float32 | tcp (ms) | verbs (ms) | verbs, message path (ms) | verbs/tcp "
          "| message path/tcp |")
    print("|---|---|---|---|---|---|")
    for size in sizes:
        tcp, verbs, message = (statistics.median(times[(t, size)]) / 1e3 for t in SYSTEMS)
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"| {label} | {tcp:.2f} | {verbs:.2f} | {message:.2f} | {verbs / tcp:.2f} | {message / tcp:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
