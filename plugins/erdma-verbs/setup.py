"""Builds the queue-pair layer's C side (cffi, API mode) against the system's libibverbs when its header is
there; without it the distribution installs without it, and choosing the transport says what to install."""

import pathlib
import sys

from setuptools import setup

if pathlib.Path("/usr/include/infiniband/verbs.h").exists():
    setup(cffi_modules=["erdma_verbs/build_ibv.py:builder"])
else:
    print("erdma-verbs: no /usr/include/infiniband/verbs.h; installing without the C side "
          "(apt-get install libibverbs-dev, then reinstall)", file=sys.stderr)
    setup()
