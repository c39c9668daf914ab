"""torch.distributed with backend "erdma": every op, and DDP reaching Gloo's parameters."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launchers import GLOO_TEARDOWN_ABORT, erdma_run, gloo_reference, torchrun, train

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("n", [2, 3])
def test_every_op_through_torch_distributed(n):
    r = erdma_run(n, str(ROOT / "tests" / "torch_ops_script.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == [f"[rank {i}] OK" for i in range(n)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
def test_every_op_on_cuda_tensors():
    """The TCP transport moves host memory, so CUDA tensors are staged through the host and copied back."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")} | {"TORCH_OPS_DEVICE": "cuda"}
    r = subprocess.run([sys.executable, "-m", "erdma_core.cli", "run", "-n", "2", "--", sys.executable,
                        str(ROOT / "tests" / "torch_ops_script.py")], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == ["[rank 0] OK", "[rank 1] OK"]


def test_counters_reach_the_erdma_group_through_torch():
    """``erdma_core.torch.counters(group=None)``: the default group's eRDMA counters, a subgroup's, and a
    ValueError for a Gloo group or before ``init_process_group``."""
    r = erdma_run(2, str(ROOT / "tests" / "torch_counters_script.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == ["[rank 0] OK", "[rank 1] OK"]


def test_a_call_torch_waits_for_at_once_runs_on_the_callers_thread():
    """``dist.all_reduce(t)``: no hand-off to a runner thread and back (4 ranks on 2 cores: 4 KiB took
    ~880 us that way, ~225 us on the caller's thread); ``async_op=True`` still progresses on its own."""
    r = erdma_run(2, str(ROOT / "tests" / "torch_threads_script.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == ["[rank 0] OK", "[rank 1] OK"]


@pytest.mark.parametrize("n", [2, 3])
def test_abort_releases_the_group_at_once_and_fails_the_peers_op(n):
    """torch's abort (torchft's reconfiguration): twelve groups aborted leave the threads and descriptors
    constant (before: 2 threads and 3 descriptors more each); a peer's op on the aborted group fails within
    seconds, naming the rank that aborted (before: it waited for the collective timeout)."""
    r = erdma_run(n, str(ROOT / "tests" / "torch_abort_script.py"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == [f"[rank {i}] OK" for i in range(n)]


def test_a_subgroup_timeout_names_torchs_group_and_the_absent_rank():
    """Before: every group was "group 0" in eRDMA's errors (each torch group is eRDMA group 0 of its own
    job), and with rank 1 absent the first rank to time out could name a neighbour instead."""
    r = erdma_run(3, str(ROOT / "tests" / "torch_blame_script.py"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == [f"[rank {i}] OK" for i in range(3)]


def test_coalescing_manager_runs_blocks_with_and_without_a_device():
    """Before: ``_coalescing_manager(device=cpu)`` failed with "Could not retrieve or create the backend  for
    device type cpu" (an empty name)."""
    r = erdma_run(3, str(ROOT / "tests" / "torch_coalescing_script.py"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == [f"[rank {i}] OK" for i in range(3)]


def test_ddp_erdma_matches_gloo_bit_for_bit(tmp_path):
    """Two ranks: each gradient element is the sum of two floats, which is the same in any order, so
    eRDMA and Gloo must give identical parameters."""
    params = {}
    for backend in ("gloo", "erdma"):
        out = tmp_path / f"{backend}.pt"
        run = gloo_reference if backend == "gloo" else erdma_run
        r = run(2, str(ROOT / "examples" / "train_ddp.py"), "--backend", backend, "--steps", "60", "--out", str(out))
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"backend={backend} world=2 steps=60" in r.stdout
        params[backend] = torch.load(out)
    assert params["gloo"].keys() == params["erdma"].keys()
    for key in params["gloo"]:
        assert torch.equal(params["gloo"][key], params["erdma"][key]), key


def test_the_ddp_example_learns_its_task():
    """``examples/train_ddp.py`` as the README runs it (300 steps, 2 ranks): rank 0 prints the mean loss of
    the first and the last 10 steps, and the last is at least 5x lower (before: 0.50 -> 0.496, the target
    was nearly noise). Each rank's data differ, so the falling loss is the averaged gradients'."""
    r = erdma_run(2, str(ROOT / "examples" / "train_ddp.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    found = re.search(r"backend=erdma world=2 steps=300 loss (\S+) -> (\S+) \((\S+)x lower\)", r.stdout)
    assert found, r.stdout
    start, end = float(found[1]), float(found[2])
    assert start >= 5 * end, r.stdout
    assert f"{start / end:.1f}" == found[3]


# Four ranks: a gradient element is a sum of four floats, and Gloo and eRDMA add them in different orders
# (ring/halving-doubling segments start at different ranks), so single steps differ by an ulp or so and
# 200 SGD steps with momentum carry that forward. The stated tolerance: every parameter within
# rtol=1e-4, atol=1e-5 of Gloo's (measured largest difference: see the issue note), and training identical
# whichever launcher starts eRDMA.
def test_ddp_on_four_ranks_matches_gloo_under_both_launchers(tmp_path):
    params = train(tmp_path, 4, {
        "gloo": (gloo_reference, ["--backend", "gloo", "--steps", "200"]),
        "erdma-run": (erdma_run, ["--backend", "erdma", "--steps", "200"]),
        "erdma-torchrun": (torchrun, ["--backend", "erdma", "--steps", "200"]),
    })
    for key, ref in params["gloo"].items():
        torch.testing.assert_close(params["erdma-run"][key], ref, rtol=1e-4, atol=1e-5)
        assert torch.equal(params["erdma-run"][key], params["erdma-torchrun"][key]), key


def test_rank_killed_mid_training_fails_the_others_with_the_cause():
    """SIGKILL one of three DDP ranks mid-training: the other two exit non-zero within seconds (timeout
    60 s), each naming the lost rank, instead of hanging in backward()."""
    from erdma_core.cli.launcher import free_port

    base = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "3", "ERDMA_TIMEOUT": "60"}
    cmd = [sys.executable, str(ROOT / "examples" / "train_ddp.py"), "--steps", "1000000", "--print-every", "10"]
    procs = [subprocess.Popen(cmd, env={**base, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(3)]
    try:
        assert procs[2].stdout is not None
        for line in procs[2].stdout:
            if line.startswith("rank 2 step 30"):
                break
        procs[2].kill()
        start = time.monotonic()
        for p in procs[:2]:
            _, err = p.communicate(timeout=50)
            assert p.returncode == 1, err[-2000:]
            assert "PeerLostError: allreduce" in err, err[-2000:]
            assert "rank 2" in err, err[-2000:]
        assert time.monotonic() - start < 50
    finally:
        for p in procs:
            p.kill()
            p.wait()


_BY_NAME = """
import sys
import torch
import torch.distributed as dist
before = "erdma_core" in sys.modules
dist.init_process_group("erdma")
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
sub = dist.new_group([0, 1])
dist.all_reduce(t, group=sub)
print(before, dist.get_backend(), t.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_the_backend_is_chosen_by_name_in_a_process_that_never_imports_erdma():
    """torch loads erdma-core's ``torch.backends`` entry point at import: "erdma" works as a plain string (as
    Lightning, accelerate or a torchtitan config pass it), and ``import torch`` imports nothing of eRDMA.
    Making the groups logs nothing from c10d's store (a look for another rank's failure used to wait 1 ms and
    leave a 'waitForInput ... timed out' line per look)."""
    from erdma_core.cli.launcher import free_port

    base = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "ERDMA_TIMEOUT": "60"}
    procs = [subprocess.Popen([sys.executable, "-c", _BY_NAME], env={**base, "RANK": str(r)}, cwd="/",
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        assert out.strip() == "False erdma [6.0, 6.0, 6.0, 6.0]", out + err[-2000:]
        assert "waitForInput" not in err, err[-3000:]


def test_torchrun_launches_the_backend():
    r = torchrun(2, str(ROOT / "tests" / "torch_ops_script.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "".join(r.stdout.split()) == "OKOK"  # both ranks print to one stdout; lines may interleave


def test_dead_peer_raises_instead_of_hanging():
    from erdma_core.cli.launcher import free_port

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


def test_a_ddp_survivor_gets_the_error_without_the_librarys_frames():
    """Rank 1 is killed under DDP; rank 0's backward raises torch's RuntimeError naming rank 1 and the op, whose
    "At:" list (the frames below the future's callback) holds the callback's own raise alone, as Work.wait's
    error carries only its raise: not the eRDMA thread that ran the op (the executor, the runner, threading)."""
    from erdma_core.cli.launcher import free_port

    base = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "ERDMA_TIMEOUT": "60"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "torch_ddp_death_script.py")],
                              env={**base, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    out0, err0 = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=120)
    said = out0[out0.index("<<<") + 3:out0.index(">>>")] if "<<<" in out0 else out0 + err0[-2000:]
    head, _, frames = said.partition("\n\nAt:\n")
    assert head.startswith("RuntimeError: Got the following error when running the callback: PeerLostError: "
                           "allreduce") and "rank 1" in head, said
    lines = frames.strip().splitlines()
    assert len(lines) == 1 and lines[0].strip().startswith(f"{ROOT / 'erdma_core' / 'torch.py'}(") \
        and lines[0].endswith("): _outcome"), said


@pytest.mark.parametrize("backend", ["gloo", "erdma"])
def test_collective_waited_for_inside_a_future_callback(backend):
    """PowerSGD's pattern: Gloo completes it; erdma deadlocked (its callback ran on erdma's single collective
    thread, which it then waited on) until blocking and callback-issued collectives ran on their own thread."""
    r = erdma_run(2, str(ROOT / "tests" / "torch_callback_script.py"), backend, timeout=120)
    if backend == "gloo" and r.returncode != 0 and GLOO_TEARDOWN_ABORT in r.stderr:
        r = erdma_run(2, str(ROOT / "tests" / "torch_callback_script.py"), backend, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == ["[rank 0] rank 0 callback OK", "[rank 1] rank 1 callback OK"]
