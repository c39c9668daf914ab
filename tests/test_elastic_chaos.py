"""CI's short chaos run: ``benchmarks/chaos.py`` with 30 events (peers SIGKILLed, SIGSTOPped and continued,
new peers, the etcd leader or another etcd member SIGKILLed and started again) on a real 3-member etcd cluster.
Every event must leave the job going: no hang, every outer step's state hash the same on every peer that
printed it, no step printed twice by a peer, none that nobody printed. The recovery times are the benchmark's
to report (docs/benchmarks.md), not this test's to bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from erdma_core.testing.etcd import missing

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(missing() is not None, reason=str(missing()))
def test_thirty_chaos_events_leave_no_hang_no_divergence_nothing_lost_or_doubled(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.chaos", "--events", "30", "--no-calm", "--seed", "7",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    said = run.stdout[-3000:] + run.stderr[-3000:]
    assert out.exists(), said
    chaos = json.loads(out.read_text())["chaos"]
    assert sum(chaos["events"].values()) == 30, said
    assert (chaos["hangs"], chaos["divergent"], chaos["doubled"], chaos["lost"], chaos["odd_exits"]) == \
        (0, 0, 0, 0, []), said
    assert run.returncode == 0, said
    assert sum(len(v) for v in chaos["recovery"].values()) == 30, said  # every event was followed by a step
    assert chaos["final_loss"] and max(chaos["final_loss"]) < 0.01, said  # the job trained to its end
