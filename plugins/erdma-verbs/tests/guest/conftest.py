"""Inside the test guest: every test leaves the rxe device's ``rdma resource`` counts (QPs, CQs, MRs, PDs) as
it found them, whatever path its processes took out (a clean close, an abort, SIGKILL)."""

from __future__ import annotations

import subprocess
import time

import pytest

DEVICE = "rxe0"


def resources() -> dict[str, int]:
    """``rdma resource`` counts of the rxe device: qp, cq, mr, pd (and the rest it lists)."""
    out = subprocess.run(["rdma", "resource", "show"], capture_output=True, text=True, check=True).stdout
    counts: dict[str, int] = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) > 1 and words[1].startswith(DEVICE):
            for key, value in zip(words[2::2], words[3::2], strict=False):
                counts[key] = int(value)
    return counts


@pytest.fixture(autouse=True)
def no_leaks():
    before = resources()
    yield
    deadline = time.monotonic() + 10  # a killed rank's resources go as the kernel reaps it
    while resources() != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert resources() == before, "rdma resources left behind"
