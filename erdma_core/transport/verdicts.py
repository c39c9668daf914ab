"""What earlier set-ups in this process learned about the paths to other sites, so that a new set-up (an elastic
job's next epoch) does not wait again for a check it already lost.

A site is a peer's public address (its NAT's, the host of its first server-reflexive candidate; its own
address when it has none): ranks behind one NAT share its verdicts. A verdict lasts ``REMEMBER_S``, then the
pair is checked again (a firewall may have opened). Only a failure is remembered; a success is checked anew each
time, and erases the failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from ..net.addresses import Candidate

REMEMBER_S = 600.0


def site(cands: Sequence[Candidate]) -> str:
    """The site a peer's published candidates say it is at."""
    srflx = [c for c in cands if c.kind == "srflx"]
    return (srflx or list(cands))[0].host if cands else ""


class Verdicts:
    """Sites a way of connecting failed to reach, and when."""

    def __init__(self) -> None:
        self._failed: dict[str, float] = {}
        self._lock = threading.Lock()

    def failed(self, where: str) -> None:
        with self._lock:
            self._failed[where] = time.monotonic()

    def worked(self, where: str) -> None:
        with self._lock:
            self._failed.pop(where, None)

    def failed_before(self, where: str) -> float | None:
        """Seconds since the way failed to reach ``where``, while that is remembered; else None."""
        with self._lock:
            at = self._failed.get(where)
            if at is None:
                return None
            ago = time.monotonic() - at
            if ago > REMEMBER_S:
                del self._failed[where]
                return None
            return ago


TCP_MEETINGS = Verdicts()  # the built-in TCP's meetings through the NATs, when a fallback takes the rest
