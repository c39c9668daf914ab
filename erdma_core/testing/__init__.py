"""Testing kit for eRDMA and its plugins: real multi-process worlds, conformance test classes (``conformance``),
schedule simulation (``schedules``), elastic jobs of real processes (``elastic``) and a file store."""

from ..discovery import FileStore
from .world import RankFailure, World

__all__ = ["FileStore", "RankFailure", "World"]  # FileStore: a job's store in a folder, for a test's ranks
