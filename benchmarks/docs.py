"""Assemble docs/benchmarks.md from one reproduce.sh output folder: the emulator's ceiling, a summary of
eRDMA's ratios to each peer, every run's tables and plots (copied next to the page), the alpha-beta check.

    python -m benchmarks.docs bench-results/docs docs/benchmarks.md
    python -m benchmarks.docs --update bench-results/docs/wan docs/benchmarks.md

``--update RUN``: one run was made again by itself (the command reproduce.sh gives for it, with the same
``--out`` name); its section, plots, summary rows and command line in the page are replaced, the rest stays.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from erdma_core.cli.bench import human

SUMMARY_SIZES = (4 << 10, 1 << 20, 64 << 20)


PEERS = ("erdma-tcp", "erdma-quic", "gloo", "mpi", "mpi-sm", "hivemind")


def _summary(cells: list[dict[str, Any]]) -> list[str]:
    lines = ["| scenario | cc | ranks | op | size | " + " | ".join(f"{p}/erdma" for p in PEERS) + " |",
             "|---|---|---|---|---|" + "---|" * len(PEERS)]
    for c in cells:
        for size in SUMMARY_SIZES:
            # JSON object keys are strings
            found = [c["ratios"].get(p, {}).get(str(size)) for p in PEERS]
            cols = ["-" if r is None else f"{r:.2f}" for r in found]
            if any(col != "-" for col in cols):
                lines.append(f"| {c['scenario']} | {c['cc']} | {c['ranks']} | {c['op']} | {human(size)} | "
                             + " | ".join(cols) + " |")
    return lines


def elastic_section(table: str) -> list[str]:
    """The section on elastic groups, around ``python -m benchmarks.elastic``'s table."""
    return _fenced("## Elastic groups: recovering from a death, admitting a peer",
            "`python -m benchmarks.elastic --scenarios loopback,continental --peers 4 --elements 1M --kills 10` "
            "(see its docstring): an elastic job of 4 peers allreducing 4 MiB of float32 per step "
            "(`erdma_core.testing.elastic_peer`); a fourth peer kills itself in the middle of an allreduce (before "
            "one of its messages, picked at random) and a new one takes its place, 10 times. Times are medians in "
            "ms. `plain P`: an allreduce call of the 4 members (its vote included); `plain P-1`: of 3 members; "
            "`death step`: the allreduce call in which a member died (the failed attempt, detection, the vote, the "
            "survivors' new group, whose set-up alone is the next column, and the allreduce again among 3); "
            "`admit`: the members' step boundary that admits a newcomer (a new group, then its set-up column, the "
            "4 MiB state to the newcomer, its hash check and vote). Ratios are against `plain P` in the same run. "
            "In the lab each peer has a namespace of its own and the store is served on the lab's host port, "
            "40 ms (`ping`) from each peer, as the peers are from each other.", table)


def chaos_section(text: str) -> list[str]:
    """The chaos soak of elastic membership on etcd (``python -m benchmarks.chaos``)."""
    return _fenced("## Elastic membership on etcd under chaos",
            "`python -m benchmarks.chaos` (see its docstring): the DiLoCo example on 4 to 6 peers whose store is a "
            "real 3-member etcd cluster on loopback, under random events: members (peers that hold the state, while "
            "more than 3 run) SIGKILLed, or SIGSTOPped and continued later, new peers, the etcd leader or another "
            "etcd member SIGKILLed and started again. Recovery is the time from an event to the next outer step "
            "completed after it; the issue's bound is the liveness timeout plus two outer steps of an undisturbed "
            "30-step run. The anchors: torchft's headline run went through 1,200 failures with no checkpoint; "
            "PCCL's master and torchft's Lighthouse are single processes.", text)


def decentralized_section(text: str) -> list[str]:
    """The whole decentralized job in the NAT bed, beside hivemind (``python -m benchmarks.decentralized``)."""
    return _fenced("## The decentralized job in the NAT bed",
            "`python -m benchmarks.decentralized` (see its docstring): the DiLoCo example with int8 pseudo-gradients "
            "on an elastic group whose membership is in an etcd member on the public segment of erdma-p2p's NAT bed; "
            "5 peers, site 0 public, sites 1-3 behind masquerade NATs, site 4 and the newcomer's behind fully-random "
            "(symmetric) ones; every site's link capped at the rate given, no delay added (no netem here). TCP "
            "through the NATs where a pair meets, QUIC (direct, or through coturn) where it cannot. The peer at site "
            "1 is SIGKILLed after an outer step, and a newcomer starts later behind the symmetric NAT. hivemind "
            "1.1.12's averager runs in the same bed at the same size with 8-bit quantization, one peer per site: "
            "site 0's (no NAT) is a full averager, so it reduces every part (hivemind puts a peer behind a NAT in "
            "client mode, which aggregates nothing), behind the same capped link as eRDMA's site-0 peer. A hivemind "
            "round counts only when its average is right (the benchmark checks each peer's mean against the mean of "
            "the contributions). "
            "The averaging time of a step is what the member that came to it last spent in the allreduce (the "
            "others also waited for its inner steps); hivemind's is its `step` call, matchmaking included, of the "
            "peer that spent least.",
            text)


def _fenced(title: str, intro: str, text: str) -> list[str]:
    """A section: its title, a paragraph, and a tool's output in a code block."""
    return [title, "", intro, "", "```", *text.strip("\n").splitlines(), "```", ""]


NOT_IN_THE_LAB = [
    "", "## Peers that are not in the lab", "",
    "PCCL (PrimeIntellect-ai/pccl) is not built here, so no run includes it. The package index reachable from "
    "here offers no `pypccl` distribution at all (`pip download pypccl`; its wheels are reported to need glibc "
    "2.38, and this host has 2.36). Its source (commit 7815195, two after the v1.0.0 release) builds six "
    "submodules. Five of them could be had (libuv, googletest, libtsp, threadpark, threadpool); the sixth, "
    "PrimeIntellect-ai/piquant, the quantization library that PCCL's `ccoip` links for its quantized "
    "reductions, could not (the PyPI package of that name is an unrelated units library). Tried on 2026-11-27.",
]


def longfat_section(table: str) -> list[str]:
    """The long, fat link: one TCP flow against a pool of connections (``python -m benchmarks.longfat``)."""
    return ["", "## A long, fat link: one connection against a pool", "",
            "The lab's `longfat` scenario (300 ms RTT, 150 Mbit/s each way per rank), two ranks, both directions "
            "busy at once (`python -m benchmarks.longfat`): first raw bulk TCP flows, one and eight each way, "
            "then a 2-rank allreduce, whose bus bandwidth is what each direction of the link carried, by eRDMA "
            "with one connection per pair and with pools (`transport.tcp.connections`), with the hosts' default "
            "socket buffers (send buffer up to 4 MiB) and with eRDMA's default (4 MiB, fixed), and by Gloo. "
            "Eight raw flows are what the emulated link carries (headers, the other direction's ACKs and the "
            "relay take the rest of the nominal rate).", "", "```", *table.splitlines(), "```"]


def build(src: Path, dest: Path) -> str:
    images = dest.parent / "benchmarks"
    if images.exists():
        shutil.rmtree(images)
    images.mkdir(parents=True)
    runs = sorted(p.parent for p in src.glob("*/results.json"))
    metas = {run: json.loads((run / "results.json").read_text())["meta"] for run in runs}
    meta = metas[runs[0]] if runs else {}
    times = sorted(m.get("time", "?") for m in metas.values()) or ["?"]
    when = times[0] if times[0] == times[-1] else f"{times[0]} to {times[-1]} (each run's own time and commit head its section)"
    md = ["# Benchmarks", "",
          "Generated by `make bench` (`benchmarks/reproduce.sh`) on "
          f"{when}, host with {meta.get('cpus', '?')} CPUs, Python {meta.get('python', '?')}. "
          "Every system runs the same collective on the same buffers; each result is checked against its "
          "expected value on every iteration (`#wrong`). Systems alternate between repeats (A B C, B C A, ...) "
          "and each time is the median over repeats of the slowest rank's mean. Ratios are peer time / eRDMA "
          "time from the same run: above 1, eRDMA is faster. On one host (`loopback`) eRDMA's ranks talk over "
          "Unix sockets (`transport.tcp.local_sockets`; messages of 1 MiB and more are read by the receiver "
          "straight from the sender's memory, `transport.tcp.single_copy_bytes`), so the local runs show it "
          "twice, as it is (`erdma`) "
          "and forced onto TCP (`erdma-tcp`), beside Open MPI over its TCP BTL (`mpi`) and over shared memory "
          "(`mpi-sm`). Across the lab's links each rank has a network namespace of its own, and eRDMA, Gloo "
          "and Open MPI all move data through TCP sockets; on the WAN links erdma-quic (QUIC over UDP) and "
          "hivemind (an averaging round of its `DecentralizedAverager` over its own libp2p daemon, matchmaking "
          "included; allreduce only) run beside them. Each plot shows the time per op against size (log-log) "
          "and the bus bandwidth.", "",
          "The runs, as `benchmarks/reproduce.sh` issued them:", "", "```"]
    cmds = src / "commands.txt"
    md += cmds.read_text().splitlines() if cmds.exists() else []
    md += ["```", "", "## The emulator's ceiling", "",
           "TCP bulk throughput through `erdma-relay` with no rate limit (`python -m benchmarks.ceiling`). "
           "No lab result above these rates measures anything but the emulator:", "", "```"]
    ceiling = src / "ceiling.txt"
    md += ceiling.read_text().splitlines() if ceiling.exists() else ["(not run)"]
    md += ["```", "", "## Summary", ""]
    all_cells = []
    for run in runs:
        all_cells += json.loads((run / "results.json").read_text())["cells"]
    md += _summary(all_cells)
    failures = [f"- {c['scenario']} ({c['cc']}) {c['ranks']} ranks {c['op']}: {s}: {why}"
                for c in all_cells for s, why in c["failures"].items()]
    if failures:
        md += ["", "Failed jobs:", "", *failures]
    profile, quic = src / "profile.txt", src / "profile-quic.txt"
    if profile.exists():
        md += ["", "## Where a 4 KiB allreduce's time goes", "",
               "Two ranks on loopback, blocking 4 KiB allreduces (`python -m benchmarks.profile_small`): wall "
               "time, CPU and context switches per op on each rank; rank 0's wall time per op split by phase with no "
               "profiler (clock reads at the seams between the engine's phases, `benchmarks/phases.py`); then rank 0 "
               "under cProfile counting that thread's CPU time (waiting for the peer or the GIL is not charged): each "
               "layer's own time per op, then the functions with the most. Under rank 0's own line, the Python "
               "bytecodes and Python-level calls it executes per op, by layer (`sys.settrace` opcode events): the "
               "interpreter's work, whatever the host's speed. A blocking collective runs on the "
               "caller's thread, which also reads and writes the sockets, so the profile of that one thread holds "
               "the whole path.", "", "```",
               *profile.read_text().splitlines(), "```"]
    if quic.exists():
        md += ["", "The same over erdma-quic (`--transport quic`). The waiting thread drives QUIC too (erdma-quic's "
               "`driver`), so this profile holds the whole path here as well: the core's layers (API and engine, "
               "matching and framing) should cost about what they cost over TCP, and the rest is erdma-quic and "
               "aioquic itself.", "", "```", *quic.read_text().splitlines(), "```"]
    md += ["", "## Alpha-beta check", "",
           "`python -m benchmarks.alphabeta --ranks 2,3,4,5,6,7,8 --iters 3` (see its docstring for the model):",
           "", "```"]
    ab = src / "alphabeta.txt"
    md += ab.read_text().splitlines() if ab.exists() else ["(not run)"]
    md += ["```", "",
           "The model assumes no contention and no loss. `drops` counts the packets the lab's rate limiters "
           "dropped during that run (`tc -s qdisc`). Ring always receives from the same neighbour; "
           "halving-doubling changes partner at every step, so when ranks drift apart a rank's downlink briefly "
           "carries two senders, its one-BDP queue overflows and TCP's loss recovery adds time the model does "
           "not have. Where `drops` is 0, the ratio measures the model itself.", ""]
    md += NOT_IN_THE_LAB
    longfat = src / "longfat.txt"
    if longfat.exists():
        md += longfat_section(longfat.read_text())
    elastic = src / "elastic.txt"
    if elastic.exists():
        md += elastic_section(elastic.read_text())
    chaos = src / "chaos.txt"
    if chaos.exists():
        md += chaos_section(chaos.read_text())
    decentralized = src / "decentralized.txt"
    if decentralized.exists():
        md += decentralized_section(decentralized.read_text())
    for run in runs:
        md += _run_section(run, images, metas[run])
    out = "\n".join(md) + "\n"
    dest.write_text(out)
    return out


def _run_section(run: Path, images: Path, meta: dict[str, Any]) -> list[str]:
    """The run's tables and plots go to a page of their own beside this one (``benchmarks/run-NAME.md``); the
    page keeps the run's heading, when and where it ran, and the link (the summary above holds its rows)."""
    text = (run / "report.md").read_text()
    for png in sorted((run / "plots").glob("*.png")):
        target = images / f"{run.name}-{png.name}"
        shutil.copy(png, target)
        text = text.replace(f"(plots/{png.name})", f"({target.name})")
    made = meta.get("time", "?") + (f", commit {meta['commit']}" if meta.get("commit") else "")
    detail = images / f"run-{run.name}.md"
    detail.write_text("\n".join([f"# Run `{run.name}`", "", f"Run on {made}. Generated with docs/benchmarks.md "
                                  "(`python -m benchmarks.docs`); its summary holds this run's rows.", "", text]))
    return [f"## Run `{run.name}`", "", f"Run on {made}. Its tables and plots: [{detail.name}](benchmarks/{detail.name}).",
            ""]


def update(run: Path, dest: Path) -> str:
    """Replace run ``run.name``'s section, plots, summary rows and command line in the page ``dest``."""
    data = json.loads((run / "results.json").read_text())
    argv = data["meta"].get("argv", [])[1:]
    if "--out" in argv:
        argv[argv.index("--out") + 1] = f"bench-results/docs/{run.name}"
    command = " ".join(["python -m benchmarks.run", *argv])
    lines = dest.read_text().split("\n")
    head = f"## Run `{run.name}`"
    if head not in lines:
        raise ValueError(f"{dest} has no section {head!r} to replace")
    start = lines.index(head)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    images = dest.parent / "benchmarks"
    for old in [*images.glob(f"{run.name}-*.png"), images / f"run-{run.name}.md"]:
        old.unlink(missing_ok=True)
    section = "\n".join(_run_section(run, images, data["meta"])).split("\n")
    lines[start:end] = section + ([""] if end < len(lines) else [])
    # the summary: this run's (scenario, cc, ranks, op) rows out, its new rows in where the first old one stood
    keys = {(c["scenario"], c["cc"], str(c["ranks"]), c["op"]) for c in data["cells"]}
    rows = [i for i, line in enumerate(lines) if line.startswith("| ") and tuple(
        cell.strip() for cell in line.split("|")[1:5]) in keys]
    new_rows = _summary(data["cells"])[2:]
    if rows:
        at, gone = rows[0], set(rows)
        lines = [line for i, line in enumerate(lines) if i not in gone]
        lines[at:at] = new_rows
    header = next((i for i, line in enumerate(lines) if line.startswith("| scenario | cc | ranks | op | size |")),
                  None)
    if header is not None:  # the peers' columns as they are now (rows of older runs leave new columns empty)
        lines[header:header + 2] = _summary([])
    out_flag = f"--out bench-results/docs/{run.name}"
    lines = [command if line.startswith("python -m benchmarks.run") and line.endswith(out_flag) else line
             for line in lines]
    out = "\n".join(lines)
    dest.write_text(out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "--update":
        update(Path(args[1]), Path(args[2]))
        return 0
    if len(args) != 2:
        print("usage: python -m benchmarks.docs RESULTS_FOLDER docs/benchmarks.md\n"
              "       python -m benchmarks.docs --update RESULTS_FOLDER/RUN docs/benchmarks.md", file=sys.stderr)
        return 2
    build(Path(args[0]), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
