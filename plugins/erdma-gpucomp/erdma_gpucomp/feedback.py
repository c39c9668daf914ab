"""Error feedback: what a lossy encode lost at one ``Site`` (a buffer, op, step and element range, the same
from one training step to the next) is added to the next encode at that Site, so over steps nothing is lost
(1-bit SGD, EF-SGD). Residuals live on the codec's device; their total is bounded, the oldest dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class ErrorFeedback:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._residuals: OrderedDict[Hashable, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # collectives of several groups may encode at once

    def __len__(self) -> int:
        return len(self._residuals)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def take(self, site: Hashable, x: Any) -> Any:
        """``x`` plus the residual kept for ``site`` (``x`` itself when there is none or it no longer fits:
        the buffer's size changed)."""
        with self._lock:
            r = self._residuals.get(site)
        if r is None or r.shape != x.shape or r.dtype != x.dtype:
            return x
        return x + r

    def keep(self, site: Hashable, residual: Any) -> None:
        with self._lock:
            old = self._residuals.pop(site, None)
            if old is not None:
                self._bytes -= old.nbytes
            if residual.nbytes > self.max_bytes:
                return
            self._residuals[site] = residual
            self._bytes += residual.nbytes
            while self._bytes > self.max_bytes:
                _, dropped = self._residuals.popitem(last=False)
                self._bytes -= dropped.nbytes
