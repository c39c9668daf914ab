"""The core's transport conformance tests, over QUIC with mutual TLS."""

from __future__ import annotations

from typing import Any

import pytest

from erdma_core.testing.conformance import TransportConformance


class TestQuicConformance(TransportConformance):
    transport = "quic"

    @pytest.fixture(autouse=True)
    def _credentials(self, quic_config: dict[str, Any]) -> None:
        self.config = quic_config


class TestQuicStripedConformance(TransportConformance):
    """The same, with every message above 64 KiB striped over the rank's own connection and a worker's."""

    transport = "quic"

    @pytest.fixture(autouse=True)
    def _credentials(self, quic_config: dict[str, Any]) -> None:
        self.config = {**quic_config, "transport.quic.workers": 1, "transport.quic.part_bytes": 65536}


def test_the_conformance_docstring_example_is_a_valid_config():
    """Before: it used transport.quic.insecure_test_certs, which does not exist."""
    import ast
    import re

    from erdma_core import load_config
    from erdma_core.testing import conformance

    doc = conformance.__doc__ or ""
    config = ast.literal_eval(re.search(r"config = (\{.*\})", doc).group(1))  # type: ignore[union-attr]
    transport = re.search(r'transport = "(\w+)"', doc).group(1)  # type: ignore[union-attr]
    conf = load_config({"transport.name": transport, **config})
    assert all(conf[k] == v for k, v in config.items())


def test_keys_dir_is_a_variable_the_plugin_declares(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: after `ERDMA_KEYS_DIR=... erdma keys init` (as the README says), every init() and
    `erdma config show` failed with "ERDMA_KEYS_DIR ... is not a config key"."""
    import subprocess
    import sys

    env = {"PATH": "/usr/bin:/bin", "ERDMA_KEYS_DIR": str(tmp_path)}
    for args in (["keys", "init"], ["config", "show"]):
        r = subprocess.run([sys.executable, "-m", "erdma_core.cli", *args], capture_output=True, text=True, env=env,
                           timeout=60)
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "ca.pem").exists() and "transport.quic.ca_cert" in r.stdout
