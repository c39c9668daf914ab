"""cffi API-mode build of the queue-pair layer's C side (``erdma_verbs._ibv``) against the system's libibverbs
(rdma-core; Debian: libibverbs-dev). Run by setup.py at install time; ``python -m erdma_verbs.build_ibv``
builds it in place."""

from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = ("ibv.c", "steps.c", "reduce.c")  # the queue-pair layer (rc.py), the compiled path (native.py)
# verbs' enumerators the Python side reads (their values found by the compiler)
CONSTANTS = "".join(f"#define {name} ...\n" for name in (
    "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_READ", "IBV_WC_SUCCESS", "IBV_WC_RECV",
    "IBV_WC_RECV_RDMA_WITH_IMM", "IBV_MTU_4096"))


def declarations() -> str:
    text = (HERE / "ibv.h").read_text()
    return text.split("/* cdef-begin */", 1)[1].split("/* cdef-end */", 1)[0] + CONSTANTS


def builder() -> FFI:
    ffi = FFI()
    ffi.cdef(declarations())
    ffi.set_source("erdma_verbs._ibv", '#include <infiniband/verbs.h>\n#include "ibv.h"',
                   sources=[os.path.relpath(HERE / n) for n in SOURCES], include_dirs=[str(HERE)], libraries=["ibverbs"],
                   extra_compile_args=["-O2", "-Wall", "-Wno-unused-function", "-ffp-contract=off"])
    return ffi


if __name__ == "__main__":
    builder().compile(tmpdir=str(HERE.parent), verbose=False)
