"""``erdma doctor``'s RDMA lines from a sysfs tree laid out as the kernel lays out /sys/class/infiniband (an rxe
device on Ethernet with a RoCEv2 GID, one without an IPv4 GID, an InfiniBand port down), and on this host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from erdma_verbs.doctor import report

SECTION = {"device": "", "gid_index": -1}
V4 = "0000:0000:0000:0000:0000:ffff:0a4d:0001"
V6 = "fe80:0000:0000:0000:0000:00ff:fe00:0001"


def port(root: Path, dev: str, num: int, state: str, link: str, gids: dict[int, tuple[str, str]]) -> None:
    p = root / dev / "ports" / str(num)
    (p / "gids").mkdir(parents=True)
    (p / "gid_attrs" / "types").mkdir(parents=True)
    (p / "state").write_text(state + "\n")
    (p / "link_layer").write_text(link + "\n")
    for i in range(4):
        gid, kind = gids.get(i, ("0000:0000:0000:0000:0000:0000:0000:0000", ""))
        (p / "gids" / str(i)).write_text(gid + "\n")
        (p / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")


def test_each_port_is_listed_with_its_gids_and_whether_it_can_be_used(tmp_path):
    port(tmp_path, "rxe0", 1, "4: ACTIVE", "Ethernet", {0: (V6, "IB/RoCE v1"), 1: (V6, "RoCE v2"),
                                                         2: (V4, "IB/RoCE v1"), 3: (V4, "RoCE v2")})
    port(tmp_path, "rxe1", 1, "4: ACTIVE", "Ethernet", {0: (V6, "IB/RoCE v1"), 1: (V6, "RoCE v2")})
    port(tmp_path, "mlx5_0", 1, "1: DOWN", "InfiniBand", {})
    lines = report(SECTION, root=tmp_path)
    assert "  rxe0 port 1: 4: ACTIVE, Ethernet, usable" in lines
    assert f"    GID 3: {V4} (RoCE v2)" in lines
    assert "  rxe1 port 1: 4: ACTIVE, Ethernet, not usable: no RoCEv2 GID on an IPv4 address (give its network " \
           "device an IPv4 address)" in lines
    assert "  mlx5_0 port 1: 1: DOWN, InfiniBand, not usable: port state 1: DOWN" in lines
    lines = report({"device": "rxe1", "gid_index": 1}, selected=True, root=tmp_path)
    assert "  rxe1 port 1: 4: ACTIVE, Ethernet, usable" in lines and not any("rxe0" in x for x in lines)


def test_no_devices_is_a_problem_only_when_verbs_is_chosen(tmp_path):
    assert report(SECTION, root=tmp_path / "absent") == [
        "verbs: no RDMA devices (/sys/class/infiniband is empty or absent: no NIC, or a kernel without RDMA)"]
    assert report(SECTION, selected=True, root=tmp_path)[0].startswith("problem: verbs: no RDMA devices")


def test_erdma_doctor_prints_the_lines_on_this_host():
    out = subprocess.run([sys.executable, "-m", "erdma_core.cli", "doctor"], capture_output=True, text=True,
                         timeout=120)
    have = Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir())
    assert ("verbs: RDMA devices:" if have else "verbs: no RDMA devices") in out.stdout, out.stdout + out.stderr
