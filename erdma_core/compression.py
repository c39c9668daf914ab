"""The compressor interface, and the built-in ``none`` compressor."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Compressor(Protocol):
    """Turns an array into bytes and back. ``encode`` returns the payload and the codec metadata the
    receiver needs (so a receiver decodes without prior agreement); ``decode`` writes into ``out``.
    ``lossy`` compressors keep their own error-feedback state per buffer they are given."""

    name: str
    lossy: bool

    def encode(self, array: np.ndarray) -> tuple[bytes | memoryview, dict[str, Any]]: ...

    def decode(self, payload: bytes | memoryview, meta: dict[str, Any], out: np.ndarray) -> None: ...


class NoCompression:
    name = "none"
    lossy = False

    def __init__(self, config: Any = None, section: dict[str, Any] | None = None) -> None:
        pass

    def encode(self, array: np.ndarray) -> tuple[memoryview, dict[str, Any]]:
        return memoryview(np.ascontiguousarray(array)).cast("B"), {}

    def decode(self, payload: bytes | memoryview, meta: dict[str, Any], out: np.ndarray) -> None:
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(payload, np.uint8)
