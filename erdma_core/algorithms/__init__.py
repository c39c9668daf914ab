"""Collective algorithms as pure schedules (see ``schedule``), registered by ``erdma_core.plugins.builtin``."""

from ..config.schema import COLLECTIVE_OPS as OPS

__all__ = ["OPS"]
