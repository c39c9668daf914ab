"""``erdma doctor``'s RDMA lines, read from sysfs (no libibverbs needed): each device's ports with their state,
link layer and GIDs, and whether the ``verbs`` transport can use it (an active port; on Ethernet a RoCEv2
GID on an IPv4 address, which the transport picks when ``gid_index`` is -1)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

SYSFS = Path("/sys/class/infiniband")
_ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def gids(port: Path) -> list[tuple[int, str, str]]:
    """(index, GID, type) of the port's GIDs that are set."""
    out = []
    for entry in sorted((port / "gids").iterdir(), key=lambda p: int(p.name)) if (port / "gids").is_dir() else []:
        gid = _read(entry)
        if gid and gid != _ZERO:
            out.append((int(entry.name), gid, _read(port / "gid_attrs" / "types" / entry.name)))
    return out


def usable(port: Path, gid_index: int) -> str | None:
    """Why the transport cannot use ``port`` (None: it can)."""
    state = _read(port / "state")
    if "ACTIVE" not in state:
        return f"port state {state or 'unknown'}"
    if _read(port / "link_layer") != "Ethernet":
        return None
    table = gids(port)
    if gid_index >= 0:
        return None if any(i == gid_index for i, _, _ in table) else f"GID index {gid_index} is not set"
    if any(g.startswith("0000:0000:0000:0000:0000:ffff:") and "v2" in t for _, g, t in table):
        return None
    return "no RoCEv2 GID on an IPv4 address (give its network device an IPv4 address)"


def report(section: dict[str, Any], selected: bool = False, root: Path = SYSFS) -> list[str]:
    devices = sorted(root.iterdir()) if root.is_dir() else []
    if not devices:
        line = "verbs: no RDMA devices (/sys/class/infiniband is empty or absent: no NIC, or a kernel without RDMA)"
        return ["problem: " + line if selected else line]
    lines = ["verbs: RDMA devices:"]
    any_ok = False
    for dev in devices:
        if section["device"] and dev.name != section["device"]:
            continue
        for port in sorted((dev / "ports").iterdir(), key=lambda p: int(p.name)):
            why = usable(port, section["gid_index"])
            any_ok |= why is None
            lines.append(f"  {dev.name} port {port.name}: {_read(port / 'state')}, {_read(port / 'link_layer')}, "
                         f"{'usable' if why is None else 'not usable: ' + why}")
            lines += [f"    GID {i}: {g} ({t or 'type unknown'})" for i, g, t in gids(port)]
    if importlib.util.find_spec("erdma_verbs._ibv") is None:
        lines.append(("problem: " if selected else "") + "verbs: erdma-verbs was installed without its C side (apt-get "
                     "install libibverbs-dev, then reinstall erdma-verbs)")
    elif selected and not any_ok:
        lines.append("problem: verbs: no usable port" + (f" on {section['device']}" if section["device"] else ""))
    return lines
