"""``erdma doctor``'s RDMA lines on a real (soft) RDMA device: rxe0 on erdma0 (10.77.0.1) is usable."""

from __future__ import annotations

from erdma_verbs.doctor import report


def test_the_rxe_device_is_listed_as_usable():
    lines = report({"device": "", "gid_index": -1}, selected=True)
    assert any(x.startswith("  rxe0 port 1: ") and x.endswith(", Ethernet, usable") for x in lines), lines
    assert any("0000:0000:0000:0000:0000:ffff:0a4d:0001 (RoCE v2)" in x for x in lines), lines
    assert not any(x.startswith("problem: ") for x in lines), lines
