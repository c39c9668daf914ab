"""The shim must import wherever DPDK's headers are installed (CI installs them: scripts/system-deps.sh); only a
machine without DPDK skips the tests that run it."""

from __future__ import annotations

import importlib
import subprocess

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
