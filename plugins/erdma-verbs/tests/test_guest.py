"""The verbs tests, run for real: a qemu guest with Debian's kernel (SoftRoCE, ``erdma_verbs.guest``) boots
with this folder shared, sets up an rxe device and runs ``tests/guest`` with pytest; its exit status and
output come back here. Skipped, with the reason, where the guest cannot be built (no root, no qemu)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from erdma_verbs import guest

HERE = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(guest.missing() is not None, reason=str(guest.missing()))
def test_the_queue_pair_tests_pass_on_softroce_in_the_guest():
    guest.image()  # built once per machine (about 2 minutes), outside the timing below
    start = time.monotonic()
    rc, out = guest.run(HERE, "sh tests/guest/run.sh", timeout=600)
    print(f"guest boot and tests: {time.monotonic() - start:.1f} s")
    assert rc == 0, out[-4000:]
    assert "3 passed" in out, out[-4000:]
