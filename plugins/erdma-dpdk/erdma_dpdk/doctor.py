"""``erdma doctor``'s DPDK lines, without starting DPDK: whether the shim was built (and so whether DPDK's
headers were there at install time), which of the transport's poll-mode drivers the system's DPDK has, and for
af_packet whether the named interface is there and up and this process may open raw sockets on it."""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Any

from .backends import BACKENDS, SYS_NET, interfaces

LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/local/lib", "/usr/local/lib64",
            "/usr/lib64", "/usr/lib")


def pmd_library(backend: str, dirs: tuple[str, ...] = LIB_DIRS) -> str | None:
    """Where the shared library of ``backend``'s PMD is, or None."""
    for d in dirs:
        found = sorted(glob.glob(os.path.join(d, f"librte_net_{backend}.so*")))
        if found:
            return found[0]
    return None


def report(section: dict[str, Any], selected: bool = False, dirs: tuple[str, ...] = LIB_DIRS) -> list[str]:
    problem = "problem: " if selected else ""
    lines = []
    built = importlib.util.find_spec("erdma_dpdk._shim") is not None
    if built:
        lines.append("dpdk: C shim built")
    else:
        lines.append(f"{problem}dpdk: C shim not built (DPDK's headers were missing when erdma-dpdk was installed: "
                     "apt-get install libdpdk-dev pkg-config, then reinstall erdma-dpdk)")
    for backend in BACKENDS:
        lib = pmd_library(backend, dirs)
        chosen = backend == section["backend"]
        state = f"usable ({lib})" if lib else "not usable: no librte_net_" + backend + " library"
        lines.append(f"  {backend}: {state}" + (" [chosen]" if chosen else ""))
        if chosen and not lib and selected:
            lines.append(f"problem: dpdk: the chosen backend {backend} has no PMD library here")
    if section["backend"] == "af_packet":
        name = section["interface"] or "(not set)"
        have = interfaces()
        if "{rank}" in name:
            found = sorted(n for n in have if n.startswith(name.split("{rank}")[0]))
            lines.append(f"  interface {name}: one per rank; here: {', '.join(found) or 'none'}")
        elif not (SYS_NET / name).exists():
            lines.append(f"{problem}dpdk: interface {name} is not here (have: {', '.join(have) or 'none'})")
        else:
            flags = int((SYS_NET / name / "flags").read_text(), 16)
            mtu = (SYS_NET / name / "mtu").read_text().strip()
            lines.append(f"  interface {name}: {'up' if flags & 1 else 'down'}, MTU {mtu}")
        if os.geteuid() != 0:
            lines.append(f"{problem}dpdk: af_packet needs root (or CAP_NET_RAW and CAP_NET_ADMIN)")
    return lines
