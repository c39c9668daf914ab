"""Collective algorithms as pure schedules (see ``schedule``), registered by ``erdma_core.plugins.builtin``."""
