"""torch.compile with the erdma backend, against Gloo bit for bit at 2 ranks: torch.compile(DDP(model)) (before,
dynamo traced into the backend's Python methods from DDP's reducer and failed: "Member 'pg' is not registered
for this opaque object type"), DDP(torch.compile(model)), and a compiled function that calls dist.all_reduce."""

from __future__ import annotations

from pathlib import Path

import pytest
from launchers import erdma_run, gloo_reference

pytest.importorskip("torch")
SCRIPT = str(Path(__file__).resolve().parent / "torch_compile_script.py")


def _results(r) -> dict[str, set[str]]:
    """Per form, the digests the ranks printed (``[rank R] RESULT FORM RANK DIGEST``)."""
    out: dict[str, set[str]] = {}
    for line in r.stdout.splitlines():
        if "RESULT " in line:
            form, _, digest = line.split("RESULT ", 1)[1].split()
            out.setdefault(form, set()).add(digest)
    return out


def test_torch_compile_forms_match_gloo_bit_for_bit():
    ours = erdma_run(2, SCRIPT, "erdma", timeout=600)
    assert ours.returncode == 0, ours.stderr[-3000:]
    gloo = gloo_reference(2, SCRIPT, "gloo", done="done")
    assert gloo.returncode == 0, gloo.stderr[-3000:]
    mine, theirs = _results(ours), _results(gloo)
    assert set(mine) == {"compile(ddp)", "ddp(compile)", "compiled-allreduce"}, ours.stdout
    for form, digests in mine.items():
        assert len(digests) == 1, (form, digests)  # every rank ends alike
        assert digests == theirs[form], (form, digests, theirs[form])  # and as Gloo's
