"""torch.distributed with backend "erdma": every op, and DDP reaching Gloo's parameters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent


def erdma_run(n, *cmd, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    return subprocess.run([sys.executable, "-m", "erdma_core.cli", "run", "-n", str(n), "--", sys.executable, *cmd],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("n", [2, 3])
def test_every_op_through_torch_distributed(n):
    r = erdma_run(n, str(ROOT / "tests" / "torch_ops_script.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == [f"[rank {i}] OK" for i in range(n)]


def test_ddp_erdma_matches_gloo_bit_for_bit(tmp_path):
    """Two ranks: each gradient element is the sum of two floats, which is the same in any order, so
    eRDMA and Gloo must give identical parameters."""
    params = {}
    for backend in ("gloo", "erdma"):
        out = tmp_path / f"{backend}.pt"
        r = erdma_run(2, str(ROOT / "examples" / "train_ddp.py"), "--backend", backend, "--steps", "60",
                      "--out", str(out))
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"backend={backend} world=2 steps=60" in r.stdout
        params[backend] = torch.load(out)
    assert params["gloo"].keys() == params["erdma"].keys()
    for key in params["gloo"]:
        assert torch.equal(params["gloo"][key], params["erdma"][key]), key
