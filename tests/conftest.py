"""The core's tests see the core alone: installed plugin distributions (erdma-quic, ...) are disabled, so
listings and "valid choices" messages do not depend on what else is installed. A run that selects a plugin's
component on purpose (``ERDMA_TRANSPORT=quic pytest tests/test_collectives.py``) keeps them."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

if "ERDMA_TRANSPORT" not in os.environ and "ERDMA_PLUGINS" not in os.environ:
    _external = sorted(ep.name for ep in entry_points(group="erdma.plugins"))
    os.environ["ERDMA_DISABLE_PLUGINS"] = ",".join(
        [*_external, *filter(None, os.environ.get("ERDMA_DISABLE_PLUGINS", "").split(","))])


import pytest


@pytest.fixture
def install_plugin(tmp_path, monkeypatch):
    """``install_plugin(name, module)``: the importable ``module`` (e.g. one in tests/) installed as a plugin
    distribution ``erdma-<name>`` (an entry point in a dist-info, in a folder of its own put on sys.path:
    entry-point caches key on sys.path) and allowed by ERDMA_PLUGINS. Returns the folder (for PYTHONPATH)."""
    names: list[str] = []

    def install(name: str, module: str):
        site = tmp_path / f"site-{name}"
        info = site / f"erdma_{name}-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: erdma-{name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[erdma.plugins]\n{name} = {module}\n")
        monkeypatch.syspath_prepend(str(site))
        # a distribution installed into a running process: stevedore lists a group's entry points once per process
        from stevedore import ExtensionManager

        monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})
        names.append(name)
        monkeypatch.setenv("ERDMA_PLUGINS", ",".join(names))
        return site

    return install
