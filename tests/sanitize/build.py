"""Builds the C this project owns with AddressSanitizer and UBSan into a folder (``python build.py OUT``):
erdma-quic's ngtcp2 shim and erdma-dpdk's shim as the cffi modules they are (each where its package would
put it under OUT, so that a driver imports it in place of the installed one), and the network lab's relay as
a program. Prints what it built; a shim whose system headers are missing (no ngtcp2, no DPDK) is skipped, and
says so."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")


def build(out: Path) -> list[str]:
    built = []
    for module, builder in (("erdma_quic.ngtcp2.build", "quic"), ("erdma_dpdk.build_shim", "dpdk")):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            print(f"sanitize: {builder}: its package is not installed; skipped", flush=True)
            continue
        mod = importlib.import_module(module)
        os.chdir(out)  # (a builder names its sources relative to where it runs, and cffi compiles in ``out``)
        try:
            ffi = mod.builder(FLAGS)
        except subprocess.CalledProcessError as exc:
            print(f"sanitize: {builder}: pkg-config finds no headers ({exc.stderr.strip()}); skipped", flush=True)
            continue
        ffi.compile(tmpdir=str(out), verbose=False)
        built.append(builder)
    relay = out / "erdma-relay"
    subprocess.run(["cc", "-O1", "-Wall", *FLAGS, "-o", str(relay), str(ROOT / "benchmarks" / "netlab" / "relay.c")],
                   check=True)
    built.append("relay")
    return built


if __name__ == "__main__":
    print("sanitize: built", ", ".join(build(Path(sys.argv[1]).resolve())), flush=True)
