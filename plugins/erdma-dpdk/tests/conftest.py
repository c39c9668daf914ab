"""The shim must import wherever DPDK's headers are installed (CI installs them: scripts/system-deps.sh); only a
machine without DPDK skips the tests that run it."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _have_dpdk() -> bool:
    try:
        return subprocess.run(["pkg-config", "--exists", "libdpdk"], check=False).returncode == 0
    except OSError:
        return False


HAVE_DPDK = _have_dpdk()
needs_dpdk = pytest.mark.skipif(not HAVE_DPDK, reason="no DPDK here (apt-get install libdpdk-dev pkg-config)")


@pytest.fixture(scope="session", autouse=True)
def shim_built() -> None:
    """Where DPDK is installed, a shim that does not import is a failed build, not a skip."""
    if HAVE_DPDK:
        importlib.import_module("erdma_dpdk._shim")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A run_dir whose memif socket paths fit a Unix socket's 107 bytes: pytest's tmp_path under a
    pytest-xdist worker (``/tmp/pytest-of-root/pytest-N/popen-gwK/<test name>/``) does not."""
    path = Path(tempfile.mkdtemp(prefix="edp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
