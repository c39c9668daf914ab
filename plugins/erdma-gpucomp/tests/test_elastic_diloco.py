"""The DiLoCo example of the core (examples/diloco.py) with its pseudo-gradients sent as int8 with error
feedback: an elastic job of 3 peers, every outer step's state hash the same on every peer, the state not the
one the same job reaches sent raw (so int8 was applied: with ``--data-seed`` the raw job repeats bit for
bit), and the final loss at most 25% above the raw job's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DILOCO = Path(__file__).resolve().parents[3] / "examples" / "diloco.py"
OUTER = re.compile(r"\[peer \d\] outer (\d+) .* hash (\w+) loss ([\d.]+)")


def _run(*extra: str) -> dict[int, set[tuple[str, str]]]:
    r = subprocess.run([sys.executable, "-m", "erdma_core.cli", "run", "--elastic", "-n", "3", "--", sys.executable,
                        str(DILOCO), "--outer-steps", "12", "--data-seed", "7", *extra],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    steps: dict[int, set[tuple[str, str]]] = {}
    for step, digest, loss in OUTER.findall(r.stdout):
        steps.setdefault(int(step), set()).add((digest, loss))
    return steps


@pytest.mark.skipif(not DILOCO.exists(), reason="needs the core's source tree (examples/)")
def test_diloco_with_int8_pseudo_gradients_keeps_every_peer_identical():
    raw, again, int8 = _run(), _run(), _run("--compress", "int8")
    assert raw == again  # deterministic, so a difference below is the codec's
    assert sorted(int8) == list(range(1, 13))
    for step, seen in int8.items():
        assert len(seen) == 1, f"outer step {step}: peers disagree: {seen}"
        assert seen != raw[step]
    raw_loss, int8_loss = float(next(iter(raw[12]))[1]), float(next(iter(int8[12]))[1])
    assert int8_loss <= raw_loss * 1.25, (raw_loss, int8_loss)
