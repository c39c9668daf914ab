"""The codecs as a job would make them (``erdma_gpucomp.plugin.make``)."""

from __future__ import annotations

from erdma_gpucomp.plugin import make

__all__ = ["make"]
