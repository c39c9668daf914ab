"""benchmarks/docs.py: a page built from two runs, then one run made again by itself and put in with
``--update``: that run's section, plots, summary rows and command change, everything else stays as it was."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import docs


def _run(folder: Path, name: str, ratio: float, when: str, text: str, plot: str) -> Path:
    run = folder / name
    (run / "plots").mkdir(parents=True)
    cell = {"scenario": name, "cc": "bbr", "ranks": 4, "op": "allreduce", "failures": {},
            "ratios": {"erdma-quic": {str(1 << 20): ratio}}}
    meta = {"cpus": 2, "python": "3.11", "time": when, "commit": "abc1234",
            "argv": ["run.py", "--scenarios", name, "--out", str(run)]}
    (run / "results.json").write_text(json.dumps({"meta": meta, "cells": [cell]}))
    (run / "report.md").write_text(f"{text}\n\n![plot](plots/{plot})\n")
    (run / "plots" / plot).write_bytes(text.encode())
    return run


def test_update_replaces_one_runs_section_rows_plots_and_command(tmp_path: Path) -> None:
    src, page = tmp_path / "all", tmp_path / "docs" / "benchmarks.md"
    page.parent.mkdir()
    for name in ("lan", "wan"):
        _run(src, name, 2.0 if name == "wan" else 0.5, "day 1", f"old {name} table", f"{name}-old.png")
    (src / "commands.txt").write_text("\n".join(f"python -m benchmarks.run --scenarios {n} --out "
                                                f"bench-results/docs/{n}" for n in ("lan", "wan")) + "\n")
    before = docs.build(src, page)
    assert "| wan | bbr | 4 | allreduce | 1M | - | 2.00 |" in before

    again = _run(tmp_path / "again", "wan", 1.25, "day 2", "new wan table", "wan-new.png")
    after = docs.update(again, page)

    assert "| wan | bbr | 4 | allreduce | 1M | - | 1.25 |" in after and "2.00" not in after
    assert "| lan | bbr | 4 | allreduce | 1M | - | 0.50 |" in after
    detail = (page.parent / "benchmarks" / "run-wan.md").read_text()  # the run's tables: a page beside it
    assert "new wan table" in detail and "old wan table" not in detail and "old wan table" not in after
    assert "Run on day 2, commit abc1234." in after and "(benchmarks/run-wan.md)" in after
    assert "old lan table" in (page.parent / "benchmarks" / "run-lan.md").read_text()
    assert after.split("## Run `lan`")[1].split("## Run `wan`")[0] == before.split("## Run `lan`")[1].split(
        "## Run `wan`")[0]
    assert "python -m benchmarks.run --scenarios wan --out bench-results/docs/wan" in after
    assert "python -m benchmarks.run --scenarios lan --out bench-results/docs/lan" in after
    assert sorted(p.name for p in (page.parent / "benchmarks").iterdir()) == [
        "lan-lan-old.png", "run-lan.md", "run-wan.md", "wan-wan-new.png"]
    assert "(wan-wan-new.png)" in detail
