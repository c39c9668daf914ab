"""Testing kit for eRDMA and its plugins: real multi-process worlds and conformance test classes."""

from .world import RankFailure, World

__all__ = ["RankFailure", "World"]
