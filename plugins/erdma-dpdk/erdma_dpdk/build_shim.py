"""cffi API-mode build of the C shim (``erdma_dpdk._shim``), against the system's DPDK (``pkg-config libdpdk``).
Run by setup.py at install time; ``python -m erdma_dpdk.build_shim`` builds it in place."""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent


def dpdk_flags() -> tuple[list[str], list[str]]:
    """Compiler and linker flags of the installed DPDK; raises CalledProcessError when pkg-config has none."""
    def pc(*args: str) -> list[str]:
        out = subprocess.run(["pkg-config", *args, "libdpdk"], check=True, capture_output=True, text=True).stdout
        return shlex.split(out)
    # rte_vdev_init is in librte_bus_vdev, which libdpdk.pc does not name
    return pc("--cflags"), [*pc("--libs"), "-lrte_bus_vdev"]


def declarations() -> str:
    text = (HERE / "shim.h").read_text()
    return text.split("/* cdef-begin */", 1)[1].split("/* cdef-end */", 1)[0]


def builder(extra: tuple[str, ...] = ()) -> FFI:
    """The cffi builder; ``extra``: more flags for compiling and linking (scripts/sanitize.sh: the sanitizers)."""
    cflags, libs = dpdk_flags()
    ffi = FFI()
    ffi.cdef(declarations())
    ffi.set_source("erdma_dpdk._shim", '#include "shim.h"', sources=[os.path.relpath(HERE / "shim.c")],
                   include_dirs=[str(HERE)], extra_compile_args=[*cflags, "-O2", "-Wall", "-Wno-unused-function", *extra],
                   extra_link_args=[*libs, *extra])
    return ffi


if __name__ == "__main__":
    builder().compile(tmpdir=str(HERE.parent), verbose=False)
