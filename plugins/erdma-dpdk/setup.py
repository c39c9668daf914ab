"""Builds the C shim (cffi, API mode) against the system's DPDK when ``pkg-config libdpdk`` finds one; without
it the distribution installs without the shim, and choosing the transport says what to install."""

import subprocess
import sys

from setuptools import setup


def have_dpdk() -> bool:
    try:
        return subprocess.run(["pkg-config", "--exists", "libdpdk"], check=False).returncode == 0
    except OSError:
        return False


if have_dpdk():
    setup(cffi_modules=["erdma_dpdk/build_shim.py:builder"])
else:
    print("erdma-dpdk: pkg-config finds no libdpdk; installing without the C shim "
          "(apt-get install libdpdk-dev pkg-config, then reinstall)", file=sys.stderr)
    setup()
