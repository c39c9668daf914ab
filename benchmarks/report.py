"""Aggregate repeated jobs into medians and ratios; print nccl-tests style tables; draw time and busbw plots."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from erdma_core.cli.bench import BUS_FACTOR, human


def median_rows(repeats: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per size: the median time over the repeats that reached that size; #wrong summed."""
    by_size: dict[int, list[dict[str, Any]]] = {}
    for rows in repeats:
        for r in rows:
            by_size.setdefault(r["size"], []).append(r)
    out = []
    for size in sorted(by_size):
        rs = by_size[size]
        t = statistics.median(r["time_us"] for r in rs)
        algbw = size / (t * 1e-6) / 1e9
        out.append(rs[0] | {"time_us": t, "algbw": algbw, "busbw": algbw * BUS_FACTOR[rs[0]["op"]](rs[0]["ranks"]),
                            "wrong": sum(r["wrong"] for r in rs), "repeats": len(rs),
                            "times_us": [r["time_us"] for r in rs]})
    return out


def ratios(results: dict[str, list[dict[str, Any]]], ours: str = "erdma") -> dict[str, dict[int, float]]:
    """peer time / our time per size (above 1: eRDMA is faster)."""
    mine = {r["size"]: r["time_us"] for r in results.get(ours, [])}
    return {peer: {r["size"]: r["time_us"] / mine[r["size"]] for r in rows if r["size"] in mine}
            for peer, rows in results.items() if peer != ours}


def table(title: str, results: dict[str, list[dict[str, Any]]], ours: str = "erdma") -> str:
    """nccl-tests' columns (bandwidths in MB/s: WAN links are slow) for every system, then eRDMA's time
    ratio to each peer."""
    lines = [f"### {title}", "", "```"]
    head = (f"{'system':>10} {'size':>10} {'count':>11} {'type':>8} {'op':>10} {'time(us)':>11} "
            f"{'algbw(MB/s)':>12} {'busbw(MB/s)':>12} {'#wrong':>7} {'runs':>5}")
    lines.append(head)
    for system, rows in results.items():
        for r in rows:
            lines.append(f"{system:>10} {human(r['size']):>10} {r['count']:>11} {r['dtype']:>8} {r['op']:>10} "
                         f"{r['time_us']:>11.1f} {r['algbw'] * 1e3:>12.2f} {r['busbw'] * 1e3:>12.2f} {r['wrong']:>7} "
                         f"{r['repeats']:>5}")
    rs = ratios(results, ours)
    if rs:
        lines += ["", f"{'size':>10} " + " ".join(f"{f'{p}/{ours}':>12}" for p in rs) + f"   (time ratio; >1: {ours} faster)"]
        sizes = [r["size"] for r in results.get(ours, [])]
        for size in sizes:
            cells = " ".join(f"{rs[p][size]:>12.2f}" if size in rs[p] else f"{'-':>12}" for p in rs)
            lines.append(f"{human(size):>10} {cells}")
    lines.append("```")
    return "\n".join(lines)


def plot(path: Path, title: str, results: dict[str, list[dict[str, Any]]]) -> bool:
    """Time per op against size (log-log: latency on the left, bandwidth on the right of the axis) and busbw
    against size, one line per system. False, drawing nothing, where matplotlib is not installed (``pip install
    'erdma-core[bench]'``): the numbers are written all the same."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, bw) = plt.subplots(1, 2, figsize=(11, 4.0), dpi=100)
    for system, rows in results.items():
        if rows:
            sizes = [r["size"] for r in rows]
            lat.plot(sizes, [r["time_us"] for r in rows], marker="o", label=system)
            bw.plot(sizes, [r["busbw"] * 1e3 for r in rows], marker="o", label=system)
    for ax, label in ((lat, "time per op (us)"), (bw, "busbw (MB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    lat.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
