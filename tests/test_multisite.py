"""examples/multisite.py, the multi-site pattern: 2 sites x 2 ranks, FSDP2 inside each site on Gloo, one
group per shard index across the sites for DiLoCo's outer steps. With the cross-site groups on eRDMA the job
equals the same job all on Gloo bit for bit (a 2-rank sum is exact in any order); with int8 across the sites
it lands within a stated tolerance of it while sending about a quarter of the bytes."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launchers import GLOO_TEARDOWN_ABORT

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "multisite.py")


def _run(tmp_path: Path, name: str, cross: str, **env: str) -> tuple[dict, list]:
    out = tmp_path / f"{name}.pt"
    base = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    for attempt in range(3):  # torch 2.13's Gloo may abort a rank in teardown, after the results (launchers.py)
        r = subprocess.run([sys.executable, "-m", "erdma_core.cli", "run", "-n", "4", "--", sys.executable, SCRIPT,
                            "--cross-backend", cross, "--out", str(out)], capture_output=True, text=True,
                           timeout=600, env=base | env)
        line = next((x for x in r.stdout.splitlines() if '{"' in x), None)
        if r.returncode == 0 or (line and GLOO_TEARDOWN_ABORT in r.stderr and attempt < 2 and out.exists()):
            break
    assert line is not None and out.exists(), (name, r.returncode, r.stderr[-3000:])
    sites = [x[x.index("site "):] for x in r.stdout.splitlines() if "site " in x and " sent " in x]
    return json.loads(line[line.index("{"):]) | {"site_lines": sites}, torch.load(out)


def test_multisite_outer_steps_on_erdma_equal_gloo_and_int8_stays_close(tmp_path):
    gloo, gloo_params = _run(tmp_path, "gloo", "gloo")
    raw, raw_params = _run(tmp_path, "erdma", "erdma")
    assert gloo["loss_after"] < 0.5 * gloo["loss_before"], gloo  # it trains
    assert raw["params"] == gloo["params"] and raw["loss_after"] == gloo["loss_after"], (raw, gloo)
    assert all(torch.equal(a, b) for a, b in zip(raw_params, gloo_params, strict=True))
    assert raw["cross_site_bytes"] == raw["pseudo_gradient_bytes"]  # uncompressed: each byte crosses once
    if importlib.util.find_spec("erdma_gpucomp") is None:
        pytest.skip("int8 comes with erdma-gpucomp, which is not installed (the uncompressed half passed)")
    int8, int8_params = _run(tmp_path, "int8", "erdma", ERDMA_COMPRESSION_NAME="int8")  # the README's command
    # int8 with error feedback: the parameters stay within 2% (relative L2) of Gloo's, the loss within 10%
    diff = sum(float((a - b).norm() ** 2) for a, b in zip(int8_params, gloo_params, strict=True)) ** 0.5
    norm = sum(float(b.norm() ** 2) for b in gloo_params) ** 0.5
    assert diff / norm < 0.02, diff / norm
    assert abs(int8["loss_after"] - gloo["loss_after"]) < 0.1 * gloo["loss_after"], (int8, gloo)
    assert int8["cross_site_bytes"] < 0.3 * int8["pseudo_gradient_bytes"], int8
    # the README's figures come from that command, with the default compression.min_bytes
    readme = (ROOT / "README.md").read_text()
    said = re.search(r"int8 erdma run -n 4 -- python examples/multisite.py`\) its parameters stayed\s+within (\S+)% "
                     r"\(relative L2\) of Gloo's, the held-out loss within (\S+)%, and the sites exchanged (\S+)x the\s+"
                     r"bytes \((\S+) MB instead of (\S+) MB", readme)
    assert said, "README.md no longer gives the multisite figures"
    assert diff / norm <= float(said[1]) / 100, (diff / norm, said[1])
    assert abs(int8["loss_after"] - gloo["loss_after"]) <= float(said[2]) / 100 * gloo["loss_after"], (int8, gloo)
    sent, plain = int8["cross_site_bytes"], int8["pseudo_gradient_bytes"]
    assert (f"{sent / plain:.2f}", f"{sent / 1e6:.2f}", f"{plain / 1e6:.2f}") == said.groups()[2:], int8
    assert int8["site_lines"] == [f"site {s} sent {sent / 2e6:.2f} MB to the other sites ({plain / 2e6:.2f} MB "
                                  f"uncompressed, {sent / plain:.2f}x)" for s in range(2)], int8  # half each
