"""A DDP training job, and an FSDP2 one, under ``erdma run`` with ERDMA_COMPRESSION=int8 and every other
setting at its default: every rank ends with the same parameters, bit for bit, close to the uncompressed
job's; every gradient message (DDP's buckets, FSDP's reduce-scatters of a layer's gradients) is encoded; with
the default ``compression.ops`` the initial parameter broadcast (DDP) and the parameter all-gathers (FSDP)
travel exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from erdma_gpucomp.device import absent, gpu_present

torch = pytest.importorskip("torch")

SCRIPT = textwrap.dedent('''
    import hashlib, json, os, torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import erdma_core.torch  # noqa: F401
    dist.init_process_group("erdma")
    rank = dist.get_rank()
    dev = torch.device(os.environ["DDP_DEVICE"])
    fsdp = os.environ["WRAP"] == "fsdp"
    torch.manual_seed(0 if fsdp else rank)  # DDP: different on every rank, its broadcast must make them equal
    model = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 1)).to(dev)
    if fsdp:  # FSDP2, a layer at a time: its reduce-scatters send 16896 bytes, then 1028
        from torch.distributed.fsdp import fully_shard
        for layer in (model[0], model[2]):
            fully_shard(layer)
        ddp = fully_shard(model)
    else:
        ddp = DDP(model, bucket_cap_mb=1)
    full = lambda p: p.full_tensor() if fsdp else p
    digest = lambda: hashlib.sha256(b"".join(full(p).detach().cpu().numpy().tobytes() for p in model.parameters()))
    start = digest().hexdigest()[:16]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(5)).to(dev)
    for _ in range(30):
        x = torch.randn(64, 32, generator=gen).to(dev)
        loss = nn.functional.mse_loss(ddp(x), x @ target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = digest().hexdigest()[:16]
    with torch.no_grad():
        x = torch.randn(1024, 32, generator=torch.Generator().manual_seed(9)).to(dev)
        held = nn.functional.mse_loss(model(x), x @ target).item()
    print(f"RESULT {rank} {start} {end} {held:.6f}", flush=True)
    print("COUNTERS " + json.dumps(erdma_core.torch.counters()), flush=True)
    dist.destroy_process_group()
''')


def job(tmp_path, codec: str, device: str = "cpu", counted: list | None = None,
        wrap: str = "ddp") -> list[tuple[str, str, float]]:
    """Two ranks train the same model with ``codec``, on ``device`` ("cuda": the model's tensors on the GPU,
    and the int8 codec encodes there), wrapped in ``wrap`` (ddp or fsdp); each rank's
    ``erdma_core.torch.counters()`` into ``counted``."""
    script = tmp_path / "ddp.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    env |= {"ERDMA_COMPRESSION": codec, "DDP_DEVICE": device, "WRAP": wrap,
            "ERDMA_COMPRESSION_INT8_DEVICE": "cuda" if device == "cuda" else "cpu"}
    out = subprocess.run([sys.executable, "-m", "erdma_core.cli", "run", "-n", "2", "--", sys.executable,
                          str(script)], capture_output=True, text=True, timeout=180, env=env)
    rows = sorted(line.split("RESULT ")[1].split() for line in out.stdout.splitlines() if "RESULT" in line)
    assert len(rows) == 2, out.stdout + out.stderr
    if counted is not None:
        counted += [json.loads(line.split("COUNTERS ", 1)[1]) for line in out.stdout.splitlines() if "COUNTERS" in line]
    return [(start, end, float(held)) for _, start, end, held in rows]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not gpu_present(), reason=f"no usable CUDA GPU ({absent()})"))])
def test_int8_ddp_ranks_agree_and_train_like_uncompressed(tmp_path, device):
    """On "cuda" the model lives on the GPU: the torch backend stages its gradients through host memory and
    the int8 codec encodes each message on the GPU."""
    counted: list[dict] = []
    plain, int8 = job(tmp_path, "none", device), job(tmp_path, "int8", device, counted)
    for rows in (plain, int8):
        assert rows[0][0] == rows[1][0]  # the parameter broadcast made every rank start alike
        assert rows[0][1] == rows[1][1]  # and they stay alike, bit for bit
    assert plain[0][0] == int8[0][0]  # the broadcast went raw: the same start as without compression
    assert plain[0][1] != int8[0][1]  # the gradients did not
    assert abs(int8[0][2] - plain[0][2]) <= 0.01 * plain[0][2], (int8[0][2], plain[0][2])
    assert len(counted) == 2, counted  # what erdma_core.torch.counters() said on each rank
    for c in counted:  # every gradient message encoded: a quarter of float32's bytes, and its scales
        raw, wire = c["compression.int8.encoded.raw_bytes"], c["compression.int8.encoded.wire_bytes"]
        assert c["compression.int8.encoded.messages"] >= 30 and 0.25 <= wire / raw <= 0.30, c


def test_int8_fsdp_compresses_each_layers_gradient_shards_by_default(tmp_path):
    """FSDP2 reduce-scatters each layer's gradients (the first layer's 8448 floats: 16.5 KiB to the other
    rank), under the 64 KiB that ``compression.min_bytes`` was before: nothing was encoded. Now each is, and
    the ranks stay alike."""
    counted: list[dict] = []
    plain, int8 = job(tmp_path, "none", counted=None, wrap="fsdp"), job(tmp_path, "int8", counted=counted,
                                                                          wrap="fsdp")
    for rows in (plain, int8):
        assert rows[0][0] == rows[1][0] and rows[0][1] == rows[1][1]  # alike at the start and the end
    assert plain[0][0] == int8[0][0] and plain[0][1] != int8[0][1]  # the same start; the gradients compressed
    assert abs(int8[0][2] - plain[0][2]) <= 0.02 * plain[0][2], (int8[0][2], plain[0][2])
    assert len(counted) == 2, counted
    for c in counted:  # 30 steps of two reduce-scatters, each message encoded; the all-gathers raw
        raw, wire = c["compression.int8.encoded.raw_bytes"], c["compression.int8.encoded.wire_bytes"]
        assert c["compression.int8.encoded.messages"] == 60 and raw == 30 * (16896 + 1028), c
        assert 0.25 <= wire / raw <= 0.30 and "compression.int8.small.messages" not in c, c
        assert c["compression.int8.uncovered.collectives"] >= 60, c  # FSDP's all-gathers, not compressed
