"""``leftovers.running``: what sweeps of leftovers rely on to tell a dead owner from a live one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from erdma_core.transport.leftovers import running


def test_a_running_process_a_zombie_and_a_reaped_one():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    assert running(child.pid) and running(os.getpid())
    child.stdin.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + 30
    while running(child.pid):  # it exits; nobody reaps it yet: a zombie, which has ended
        assert time.monotonic() < deadline, "the child did not exit within 30 s"
        time.sleep(0.02)
    assert child.poll() == 0 and not running(child.pid)

