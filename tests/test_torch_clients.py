"""PyTorch's own clients on backend "erdma" against "gloo": DDP's PowerSGD communication hook, Lightning's
``sync_dist``, DCP's ``async_save``, the bitwise reduce ops, integer AVG; under erdma run and torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launchers import erdma_run, gloo_reference, torchrun, train

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent
JSON = '{"'  # the line rank 0 prints once its results are in


def _json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if "{" in line]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0][lines[0].index("{"):])


def test_ddp_with_powersgd_matches_gloo_bit_for_bit(tmp_path):
    """DDP with the PowerSGD hook (rank 1, from step 3): its callbacks issue allreduces and wait for them
    inside other allreduces' futures (erdma once deadlocked there). Two ranks add two floats, the same in
    any order, so the parameters and the loss at every step equal Gloo's; a plain run differs, so the hook
    took effect."""
    args = ["--steps", "30", "--powersgd-start", "3"]
    results = train(tmp_path, 2, {
        "gloo": (gloo_reference, ["--backend", "gloo", *args]),
        "erdma-run": (erdma_run, ["--backend", "erdma", *args]),
        "erdma-torchrun": (torchrun, ["--backend", "erdma", *args]),
        "plain": (erdma_run, ["--backend", "erdma", "--steps", "30"]),
    })
    ref = results["gloo"]
    for name in ("erdma-run", "erdma-torchrun"):
        assert results[name].keys() == ref.keys()
        for key in ref:
            assert torch.equal(results[name][key], ref[key]), (name, key)
    plain = results["plain"]["losses"]
    assert torch.equal(plain[:4], ref["losses"][:4])  # the same until PowerSGD starts (steps 0-2, and 3's loss)
    assert not torch.equal(plain, ref["losses"])


def test_lightning_sync_dist_matches_gloo():
    """Lightning logs with sync_dist=True and reduces with ReduceOp.AVG (on int64 too) on every backend not
    named "gloo"; erdma refused integer AVG. The logged metrics equal Gloo's, launched either way."""
    pytest.importorskip("lightning")
    script = str(ROOT / "tests" / "lightning_script.py")
    metrics = {}
    for name, r in (("gloo", gloo_reference(2, script, "gloo", done=JSON)), ("erdma-run", erdma_run(2, script, "erdma")),
                    ("erdma-torchrun", torchrun(2, script, "erdma"))):
        assert r.returncode == 0, (name, r.stderr[-3000:])
        metrics[name] = _json(r.stdout)
    assert set(metrics["gloo"]) == {"train_loss", "val_loss", "val_positive"}
    assert metrics["erdma-run"] == metrics["gloo"] and metrics["erdma-torchrun"] == metrics["gloo"]


def test_accelerate_trains_on_erdma_as_on_gloo():
    """accelerate on CPU picks Gloo for the group it makes and refuses another name; with the default group
    made first by name (README), it trains on eRDMA: losses, gather, reduce and parameters equal Gloo's."""
    pytest.importorskip("accelerate")
    script = str(ROOT / "tests" / "accelerate_script.py")
    results = {}
    for name, r in (("gloo", gloo_reference(2, script, "gloo", done=JSON)), ("erdma", erdma_run(2, script, "erdma")),
                    ("erdma-torchrun", torchrun(2, script, "erdma"))):
        assert r.returncode == 0, (name, r.stderr[-3000:])
        results[name] = _json(r.stdout)
    assert [results[n].pop("backend") for n in results] == ["gloo", "erdma", "erdma"]
    assert results["gloo"]["gathered"] == [1, 11] and len(results["gloo"]["losses"]) == 20
    assert results["erdma"] == results["gloo"] and results["erdma-torchrun"] == results["gloo"]


def _wrapped(values: list[int], dtype: torch.dtype) -> int:
    """The sum of ``values`` as ``dtype`` holds it (integer sums wrap)."""
    return torch.tensor(sum(values), dtype=torch.int64).to(dtype).item()


def _avg_ref(p: int, dtype: torch.dtype) -> list[int]:
    lo = 0 if dtype == torch.uint8 else -50
    out = []
    for i in range(60):
        inputs = [torch.tensor((lo + i) * (r + 1) + int(r == 0), dtype=torch.int64).to(dtype).item() for r in range(p)]
        s = _wrapped(inputs, dtype)
        out.append(s // p if s >= 0 else -(-s // p))  # truncated toward zero, as NCCL's integer AVG
    return out


@pytest.mark.parametrize("launcher", ["erdma-run", "torchrun"])
def test_bitwise_ops_int_avg_and_async_save(tmp_path, launcher):
    """Three ranks. BAND/BOR/BXOR on int8/32/64, uint8 and bool equal Gloo's results (all_reduce, reduce,
    reduce_scatter); integer AVG truncates toward zero like NCCL; uneven all_to_all lists and a stacked
    all_gather_into_tensor output (which Gloo refuses) work; PREMUL_SUM is refused by name (the error
    once printed '<ReduceOp object at 0x...>'); DCP async_save then load works (the group serves the CPU
    device) and loads what Gloo's run loads."""
    script = str(ROOT / "tests" / "torch_clients_script.py")
    backend = "erdma" if launcher == "erdma-run" else "cpu:erdma"
    ref = gloo_reference(3, script, "gloo", str(tmp_path / "gloo"), done="done")
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = erdma_run if launcher == "erdma-run" else torchrun
    r = run(3, script, backend, str(tmp_path / "erdma"))
    assert r.returncode == 0, r.stderr[-3000:]
    gloo, ours = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("gloo", "erdma"))
    for key, value in gloo.items():
        if key != "bxor on float32":
            assert ours[key] == value, key
    assert "cpu" in ours["devices"]
    # DCP keeps one copy of a tensor it takes as replicated (the same one under Gloo, compared above)
    assert ours["dcp"]["w"] == [[float(4 * i + j) for j in range(4)] for i in range(3)] and ours["dcp"]["step"] in (7, 8, 9)
    assert ours["uneven all_to_all"] == [[float(10 * q)] * (q + 1) for q in range(3)]  # rank 0's view
    assert ours["stacked all_gather_into_tensor"] == [[float(q)] * 3 for q in range(3)]
    for dtype in (torch.int64, torch.int32, torch.uint8):
        assert ours[f"avg {dtype}"] == _avg_ref(3, dtype), dtype
    assert ours["bxor on float32"] == ("TypeError: ReduceOp.BXOR needs an integer or bool dtype (int8, int16, int32, "
                                       "int64, uint8, bool), got float32")
    assert ours["premul_sum"] == ("ValueError: ReduceOp.PREMUL_SUM is not supported by the erdma backend; supported: "
                                  "SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR")
