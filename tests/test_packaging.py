"""Every distribution of the repository installs without setuptools deprecation warnings (an SPDX license
string needs setuptools 77) and depends on erdma-core within one minor version; only a distribution that
compiles a C shim with cffi (erdma-dpdk) needs more to build."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECTS = sorted([ROOT / "pyproject.toml", *ROOT.glob("plugins/*/pyproject.toml"),
                   *ROOT.glob("examples/*/pyproject.toml")])


@pytest.mark.parametrize("path", PROJECTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_project_metadata_is_current(path):
    data = tomllib.loads(path.read_text())
    builds_c = (path.parent / "setup.py").is_file() and "cffi_modules" in (path.parent / "setup.py").read_text()
    assert data["build-system"]["requires"] == ["setuptools>=77", *(["cffi>=1.15"] if builds_c else [])]
    assert isinstance(data["project"]["license"], str)  # a table is deprecated
    if data["project"]["name"] != "erdma-core":
        assert "erdma-core>=0.1,<0.2" in data["project"]["dependencies"]


def test_core_layout_shows_the_layers():
    """The public API, the collective engine, the transports, discovery, plugin machinery and the command
    line are packages of their own; only the interfaces every layer shares sit at the top (before: 21 flat
    modules, one of them a setup.py holding init)."""
    core = ROOT / "erdma_core"
    assert sorted(p.stem for p in core.glob("*.py")) == ["__init__", "compression", "errors", "logs", "sdk", "toolkit",
                                                         "torch", "torchft", "traversal", "wire"]
    # (torch, torchft: the framework front ends; sdk: the plugin contract, toolkit: what plugins build on; logs:
    # ERDMA_DEBUG; wire: the wire format that security and the transports stand on)
    assert sorted(p.name for p in core.iterdir() if (p / "__init__.py").is_file()) == [
        "algorithms", "api", "cli", "config", "discovery", "elastic", "engine", "net", "plugins", "protocol",
        "security", "testing", "transport"]


def test_stream_transports_write_only_set_up_and_byte_movement():
    """TCP keeps no matching, ABORT or BYE code of its own: the base does it once for every transport."""
    from erdma_core.transport.base import MessageTransport
    from erdma_core.transport.stream.socket_transport import SocketTransport
    from erdma_core.transport.tcp import TcpTransport

    assert issubclass(TcpTransport, SocketTransport) and issubclass(SocketTransport, MessageTransport)
    shared = {"connect", "isend", "irecv", "begin", "abort", "close", "peer_lost"}
    for cls in (TcpTransport, SocketTransport):
        assert not shared & set(vars(cls)), (cls, shared & set(vars(cls)))
    assert set(vars(TcpTransport)) - {"__module__", "__doc__", "__init__", "__qualname__", "__firstlineno__",
                                      "__static_attributes__"} == {"name", "key", "devices", "listen", "dial", "tune",
                                                                   "meeting_point", "nearby"}


JOB = """
import numpy as np, erdma_core
pg = erdma_core.init()
x = np.arange(1 << 16, dtype=np.float32) * (pg.rank() + 1)
pg.allreduce(x)
assert np.array_equal(x, np.arange(1 << 16, dtype=np.float32) * 3), x[:4]
print("rank", pg.rank(), "ok")
pg.destroy()
"""


def test_readmes_install_line_from_a_checkout_gives_a_working_quic_job(tmp_path):
    """What a user without make does (README, "Installing without make"): a fresh virtualenv, the README's pip
    line run in a copy of the checkout (only what git tracks, so nothing built here rides along), then a 2-rank
    allreduce over erdma-quic on its compiled engine from that virtualenv alone."""
    import os
    import re
    import shutil
    import subprocess
    import sys

    line = re.search(r"^pip install (\. [^\n#`]*)", (ROOT / "README.md").read_text(), re.M)
    assert line, "README.md has no from-checkout pip line"
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to copy what it tracks")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True, timeout=60).stdout.decode().split("\0")
    src = tmp_path / "checkout"
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ERDMA_", "VIRTUAL_ENV", "PYTHON"))}
    r = subprocess.run([str(venv / "bin/pip"), "install", "-q", *line.group(1).split()], cwd=src, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    (tmp_path / "job.py").write_text(JOB)
    # the compiled engine by name: a PluginError naming what to install where it was not built
    env |= {"ERDMA_TRANSPORT": "quic", "ERDMA_TRANSPORT_QUIC_SECRET": "install-test",
            "ERDMA_TRANSPORT_QUIC_ENGINE": "ngtcp2"}
    r = subprocess.run([str(venv / "bin/erdma"), "run", "-n", "2", "--", str(venv / "bin/python"),
                        str(tmp_path / "job.py")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count(" ok") == 2, r.stdout
