"""``erdma doctor``'s DPDK lines: the shim, each backend's PMD library, the interface for af_packet."""

from __future__ import annotations

from erdma_dpdk.doctor import pmd_library, report

from erdma_core import load_config


def _section(**options: object) -> dict:
    return load_config({"transport.name": "dpdk", **{f"transport.dpdk.{k}": v for k, v in options.items()}}
                       ).section("transport.dpdk")


def test_a_backend_without_its_pmd_library_is_a_problem_when_chosen(tmp_path):
    (tmp_path / "librte_net_memif.so.23").write_text("")
    lines = report(_section(backend="af_packet", interface="lo"), selected=True, dirs=(str(tmp_path),))
    assert f"  memif: usable ({tmp_path}/librte_net_memif.so.23)" in lines
    assert "  af_packet: not usable: no librte_net_af_packet library [chosen]" in lines
    assert "problem: dpdk: the chosen backend af_packet has no PMD library here" in lines
    assert any(line.startswith("  interface lo: up, MTU ") for line in lines)


def test_a_missing_interface_is_a_problem_when_the_transport_is_chosen(tmp_path):
    lines = report(_section(backend="af_packet", interface="nosuch0"), selected=True, dirs=(str(tmp_path),))
    assert any(line.startswith("problem: dpdk: interface nosuch0 is not here (have: ") for line in lines)
    lines = report(_section(backend="af_packet", interface="nosuch0"), selected=False, dirs=(str(tmp_path),))
    assert not any(line.startswith("problem:") for line in lines)


def test_this_host(tmp_path):
    lines = report(_section())
    from .conftest import HAVE_DPDK

    assert lines[0] == ("dpdk: C shim built" if HAVE_DPDK else lines[0])
    assert (pmd_library("memif") is not None) == HAVE_DPDK
