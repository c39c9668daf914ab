"""A lossy compressor: float32 and float64 travel as float16 (half or a quarter of the bytes). The rounding
error of each send is kept per ``Site`` and added to the next send from the same site (error feedback), so
over many steps nothing is lost; finite values beyond float16's range are clipped, and the clipped part is
carried over the same way; inf and nan arrive as they were sent."""

from __future__ import annotations

from typing import Any

import numpy as np

from erdma_core.sdk import Encoded, Site

_MAX = float(np.finfo(np.float16).max)


class Half:
    name = "half"
    lossy = True

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        self.feedback = section["error_feedback"]
        self.residuals: dict[Site, np.ndarray] = {}

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Encoded | None:
        if dtype not in ("float32", "float64"):
            return None  # other dtypes go raw
        keep = self.feedback and site is not None
        x = data + self.residuals[site] if keep and site in self.residuals else data
        finite = np.isfinite(x)  # inf and nan travel as they are (an overflow must stay visible), never clipped
        half = np.where(finite, np.clip(x, -_MAX, _MAX), x).astype(np.float16)
        if keep:
            self.residuals[site] = np.where(finite, x - half, 0)
        return Encoded(half)

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None:
        out[:] = np.frombuffer(payload, np.float16)
