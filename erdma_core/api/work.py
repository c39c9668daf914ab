"""``Work``: the handle of an asynchronous collective, as in torch.distributed."""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable
from typing import Any

from ..errors import CollectiveTimeoutError, ErdmaError
from .serial import blocking

log = logging.getLogger("erdma")


def bare(exc: ErdmaError) -> ErdmaError:
    """``exc``, to raise again where the API returns to its caller without the library's own frames and
    chained causes (its message names the rank, the op, the peer and the cause already): a rank that fails
    because another did prints one error, not pages of eRDMA's internals. The whole traceback is logged
    at DEBUG (logger "erdma")."""
    log.debug("%s", exc, exc_info=exc)
    exc.__cause__ = None
    exc.__suppress_context__ = True
    return exc.with_traceback(None)


class Work:
    def __init__(self, future: cf.Future[Any], op: str, rank: int,
                 run_here: Callable[[cf.Future[Any]], None] | None = None) -> None:
        """``run_here(future)``: run the collective on the waiting thread if it has not started (``Serial.help``)."""
        self._future = future
        self.op = op
        self._rank = rank
        self._run_here = run_here

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (at most ``timeout`` seconds); raise the op's error. Returns True."""
        if timeout is None and not self._future.done() and self._run_here is not None:
            self._run_here(self._future)  # (not with a timeout: the call may take as long as it takes here)
        if not self._future.done():
            with blocking():  # from a completion callback: the queue must not wait for this thread
                try:
                    self._future.exception(timeout)
                except cf.TimeoutError:
                    raise CollectiveTimeoutError(f"rank {self._rank}: Work.wait({timeout}) for {self.op} timed out",
                                                 rank=self._rank, op=self.op) from None
        try:
            self._future.result()
        except ErdmaError as exc:
            raise bare(exc) from None
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
