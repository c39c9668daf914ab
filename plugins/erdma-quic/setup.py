"""Builds the compiled QUIC engine's C shim (cffi, API mode) against the system's ngtcp2 and GnuTLS when
``pkg-config`` finds them; without them the distribution installs without it (the aioquic engine still
works), and choosing the compiled engine says what to install."""

import subprocess
import sys

from setuptools import setup

PACKAGES = ("libngtcp2", "libngtcp2_crypto_gnutls", "gnutls")


def have_ngtcp2() -> bool:
    try:
        return subprocess.run(["pkg-config", "--exists", *PACKAGES], check=False).returncode == 0
    except OSError:
        return False


if have_ngtcp2():
    setup(cffi_modules=["erdma_quic/ngtcp2/build.py:builder"])
else:
    print("erdma-quic: pkg-config finds no ngtcp2/GnuTLS; installing without the compiled engine "
          "(apt-get install libngtcp2-dev libngtcp2-crypto-gnutls-dev libgnutls28-dev pkg-config, then reinstall)",
          file=sys.stderr)
    setup()
