"""cffi API-mode build of the engine's C shim (``erdma_quic.ngtcp2._shim``) against the system's ngtcp2 and
GnuTLS (``pkg-config libngtcp2 libngtcp2_crypto_gnutls gnutls``). Run by setup.py at install time;
``python -m erdma_quic.ngtcp2.build`` builds it in place."""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
PACKAGES = ("libngtcp2", "libngtcp2_crypto_gnutls", "gnutls")
SOURCES = ("shim.c", "tickets.c", "demux.c", "sockio.c")
HEADERS = ("demux.h", "sockio.h", "shim.h")  # cffi's declarations, in this order


def flags() -> tuple[list[str], list[str]]:
    """Compiler and linker flags; raises CalledProcessError when pkg-config lacks one of PACKAGES."""
    def pc(option: str) -> list[str]:
        out = subprocess.run(["pkg-config", option, *PACKAGES], check=True, capture_output=True, text=True).stdout
        return shlex.split(out)
    return pc("--cflags"), pc("--libs")


def declarations() -> str:
    """What cffi sees: the marked part of each header, the types before what uses them."""
    parts = []
    for name in HEADERS:
        text = (HERE / name).read_text()
        parts.append(text.split("/* cdef-begin */", 1)[1].split("/* cdef-end */", 1)[0])
    return "\n".join(parts)


def builder(extra: tuple[str, ...] = ()) -> FFI:
    """The cffi builder; ``extra``: more flags for compiling and linking (scripts/sanitize.sh: the sanitizers)."""
    cflags, libs = flags()
    ffi = FFI()
    ffi.cdef(declarations())
    ffi.set_source("erdma_quic.ngtcp2._shim", "".join(f'#include "{h}"\n' for h in HEADERS),
                   sources=[os.path.relpath(HERE / name) for name in SOURCES],
                   include_dirs=[str(HERE)], extra_compile_args=[*cflags, "-O2", "-Wall", *extra],
                   extra_link_args=[*libs, *extra])
    return ffi


if __name__ == "__main__":
    builder().compile(tmpdir=str(HERE.parent.parent), verbose=False)
