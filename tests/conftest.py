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
