"""``transport.tcp.congestion``: the controller every TCP data connection runs, set per socket (TCP_CONGESTION),
read back from the connections of a real pair of ranks; a name the kernel does not offer is refused naming the
key, the value and the ones it offers; ``erdma doctor`` says what runs."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from erdma_core.discovery import FileStore
from erdma_core.errors import ConfigError
from erdma_core.net import congestion
from erdma_core.plugins.builtin import TCP_OPTIONS
from erdma_core.transport.base import TransportContext
from erdma_core.transport.tcp import TcpTransport

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="no TCP_CONGESTION (not Linux)")


def _controllers(setting: str, tmp_path) -> list[str]:
    """The controller of each TCP connection of rank 0 of a two-rank pair set up with ``setting``."""
    store = FileStore(tmp_path / "store")
    out: dict[int, list[str] | BaseException] = {}

    def rank(r: int) -> None:
        t = TcpTransport(None, {k: o.default for k, o in TCP_OPTIONS.items()} |
                         {"local_sockets": False, "congestion": setting, "connections": 2})
        try:
            t.connect(TransportContext(rank=r, world_size=2, store=store, job=0xC0, connect_timeout=10.0,
                                       secret=b"s"))
            socks = [ch.sock for lanes in t.lanes.values() for ch in lanes if ch.sock.family == socket.AF_INET]
            out[r] = [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
                      for s in socks]
        except BaseException as exc:
            out[r] = exc
        finally:
            t.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert all(isinstance(out.get(r), list) and out[r] for r in (0, 1)), out
    return out[0] + out[1]  # type: ignore[operator]


@pytest.mark.skipif(not congestion.usable("bbr"), reason="this kernel offers no bbr")
def test_auto_runs_bbr_on_every_data_connection_whatever_the_host_default(tmp_path):
    assert set(_controllers("auto", tmp_path)) == {"bbr"}


@pytest.mark.skipif(not congestion.usable("reno"), reason="this kernel offers no reno")
def test_a_named_controller_runs_and_host_keeps_the_hosts_default(tmp_path):
    assert set(_controllers("reno", tmp_path / "a")) == {"reno"}
    assert set(_controllers("host", tmp_path / "b")) == {congestion.host_default()}


def test_a_controller_the_kernel_does_not_offer_is_refused_naming_key_value_and_choices():
    with pytest.raises(ConfigError, match=r"'transport.tcp.congestion': 'nonesuch' is not a congestion controller "
                                          r"this kernel offers; valid: auto, host, .*reno"):
        TcpTransport(None, {k: o.default for k, o in TCP_OPTIONS.items()} | {"congestion": "nonesuch"})


def test_erdma_doctor_says_which_controller_runs_and_flags_one_the_kernel_lacks():
    run = subprocess.run([sys.executable, "-m", "erdma_core.cli", "doctor"], capture_output=True, text=True,
                         timeout=120)
    runs = congestion.choose("auto") or f"the host's default, {congestion.host_default()}"
    assert f"TCP congestion control: {runs} on erdma's TCP connections (transport.tcp.congestion = auto" \
        in run.stdout, run.stdout[-2000:]
    assert congestion.describe("nonesuch").startswith("problem: config key 'transport.tcp.congestion': 'nonesuch'")
