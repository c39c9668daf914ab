"""The verbs tests, run for real: a qemu guest with Debian's kernel (SoftRoCE, ``erdma_verbs.guest``) boots once
with the checkout and this Python shared at their own paths, sets up an rxe device and runs, in this very
interpreter and virtualenv, ``tests/guest`` and then the core's collective tests over ``transport = "verbs"``
on 4 ranks; each suite's exit status and output come back here. Skipped, with the reason, where the
guest cannot be built (no root, no qemu)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from erdma_verbs import guest

HERE = Path(__file__).resolve().parent.parent
CHECKOUT = HERE.parent.parent
pytestmark = pytest.mark.skipif(guest.missing() is not None, reason=str(guest.missing()))


@pytest.fixture(scope="module")
def suites() -> dict[str, tuple[int, str]]:
    """Boot the guest once and run both suites in it (``tests/guest/both.sh``): each suite's exit status and
    output, by name. A boot costs minutes under emulation; one boot serves both tests below."""
    guest.image()  # built once per machine (about 2 minutes), outside the timing below
    start = time.monotonic()
    rc, out = guest.run(HERE, f"sh tests/guest/run.sh sh tests/guest/both.sh {sys.executable} {CHECKOUT}",
                        timeout=2700, shares=[CHECKOUT, *guest.host_python()])
    print(f"guest boot and both suites: {time.monotonic() - start:.1f} s")
    found = {}
    for name in ("verbs", "collectives"):
        status, output = HERE / f".guest-{name}.rc", HERE / f".guest-{name}.out"
        assert status.exists(), f"the guest ran no {name} suite (exit status {rc}): {out[-6000:]}"
        found[name] = int(status.read_text().strip() or "1"), output.read_text(errors="replace")
    return found


def passed(out: str) -> int:
    found = re.findall(r"(\d+) passed", out)
    return int(found[-1]) if found else 0


def test_the_verbs_tests_pass_on_softroce_in_the_guest(suites):
    rc, out = suites["verbs"]
    assert rc == 0, out[-6000:]
    assert passed(out) == 34 and "failed" not in out and "skipped" not in out, out[-4000:]


def test_the_core_collective_tests_pass_over_verbs_on_4_ranks(suites):
    rc, out = suites["collectives"]
    assert rc == 0, out[-6000:]
    assert passed(out) >= 15 and "failed" not in out, out[-4000:]
