"""coturn on loopback, for the tests that ask a real STUN or TURN server (no namespaces: test_nat.py's bed runs
its own)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

TURN_USER, TURN_PASSWORD = "erdma", "loopback-secret"


def _coturn(tmp: Path, *flags: str) -> Iterator[tuple[str, int]]:
    """coturn listening on a free loopback port with ``flags``; its address, until the test is over."""
    if shutil.which("turnserver") is None:
        pytest.skip("coturn is not installed (scripts/system-deps.sh test installs it)")
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    proc = subprocess.Popen(["turnserver", "-L", "127.0.0.1", "-p", str(port), *flags, "--no-cli", "--no-tls",
                             "--no-dtls", "--pidfile", str(tmp / "turn.pid")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    yield "127.0.0.1", port
    proc.terminate()
    proc.wait(5)


@pytest.fixture
def coturn(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """STUN only."""
    yield from _coturn(tmp_path, "--stun-only")


@pytest.fixture
def turn_relay(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """STUN and TURN relaying on loopback: ``HOST:PORT``, and the long-term credential's user and password."""
    for host, port in _coturn(tmp_path, "--relay-ip", "127.0.0.1", "--lt-cred-mech",
                              f"--user={TURN_USER}:{TURN_PASSWORD}", "--realm=erdma.test", "--allow-loopback-peers"):
        yield f"{host}:{port}", TURN_USER, TURN_PASSWORD


@pytest.fixture
def honest() -> Iterator[tuple[str, list[tuple[str, int]]]]:
    """Two served DHT nodes (``erdma dht serve``): a job's URL prefix and their addresses."""
    from test_dht import _free_udp_port, _serve

    ports = [_free_udp_port(), _free_udp_port()]
    procs = [_serve(ports[0])]
    procs.append(_serve(ports[1], f"127.0.0.1:{ports[0]}"))
    yield f"dht://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", [("127.0.0.1", p) for p in ports]
    for p in procs:
        p.terminate()
        p.wait(10)
