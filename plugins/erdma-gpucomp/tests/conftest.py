"""Codec instances for the tests, made through the plugin's registration as a job would make them."""

from __future__ import annotations

from typing import Any

import pytest
from erdma_gpucomp import plugin

from erdma_core.config import Option

REGISTERED: dict[str, tuple[Any, dict[str, Option]]] = {}
plugin.erdma_register_compressors(
    lambda name, factory, *, options=None, description="": REGISTERED.__setitem__(name, (factory, options or {})))


def make(name: str, sending: bool = True, **settings: Any) -> Any:
    """The compressor ``name`` with its defaults and ``settings``, as the sending rank (or a receiver)."""
    factory, options = REGISTERED[name]
    section = {key: opt.default for key, opt in options.items()} | settings
    return factory({"compression.name": name if sending else "none"}, section)


@pytest.fixture
def codec():
    return make
