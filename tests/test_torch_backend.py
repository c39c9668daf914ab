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


def test_torchrun_launches_the_backend():
    from erdma_core.launcher import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), str(ROOT / "tests" / "torch_ops_script.py")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "".join(r.stdout.split()) == "OKOK"  # both ranks print to one stdout; lines may interleave


def test_dead_peer_raises_instead_of_hanging():
    from erdma_core.launcher import free_port

    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "ERDMA_TIMEOUT": "60"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "torch_peer_death_script.py")],
                              env={**base, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    out0, err0 = procs[0].communicate(timeout=40)  # far below the 60 s collective timeout
    procs[1].communicate(timeout=40)
    assert out0.startswith("PeerLostError: allreduce"), out0 + err0[-2000:]
    assert "rank 1" in out0
