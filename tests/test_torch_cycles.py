"""A group made and given back through torch.distributed returns everything it took when it is destroyed or
aborted, without waiting for the garbage collector: 50 groups in a row on one port (rank 0 serves torch's store
there each time, so the last one's must be closed), with the same Python threads, OS threads and descriptors
after the 50th as after the 1st (as Gloo: the script takes its name too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from erdma_core.cli.launcher import free_port

SCRIPT = str(Path(__file__).with_name("torch_cycles_script.py"))
CYCLES = 50


@pytest.mark.parametrize("mode", ["destroy", "abort"])
def test_fifty_groups_on_one_port_give_back_what_they_took(tmp_path, mode):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")} | {"PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, SCRIPT, "erdma", str(CYCLES), mode, str(tmp_path)],
                              env=env | {"RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    for out, _ in outs:
        rows = json.loads(out.strip().splitlines()[-1])
        assert len(rows) == CYCLES
        assert rows[-1] == rows[0] and max(r[2] for r in rows) == rows[0][2], rows  # flat: threads, descriptors
