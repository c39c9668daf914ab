"""``Work``: the handle of an asynchronous collective, as in torch.distributed."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

from ..errors import CollectiveTimeoutError


class Work:
    def __init__(self, future: cf.Future[Any], op: str, rank: int) -> None:
        self._future = future
        self.op = op
        self._rank = rank

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (at most ``timeout`` seconds); raise the op's error. Returns True."""
        done, _ = cf.wait([self._future], timeout)
        if not done:
            raise CollectiveTimeoutError(f"rank {self._rank}: Work.wait({timeout}) for {self.op} timed out",
                                         rank=self._rank, op=self.op)
        self._future.result()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def result(self) -> Any:
        return self._future.result()

    def get_future(self) -> cf.Future[Any]:
        return self._future
