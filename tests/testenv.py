"""A plugin that reads an environment variable of its own (as erdma-quic reads ERDMA_KEYS_DIR)."""

from __future__ import annotations

from typing import Any

from erdma_core import hookimpl


@hookimpl
def erdma_register_environment(register: Any) -> None:
    register("ERDMA_TESTENV_DIR", "where the test plugin keeps its files")
