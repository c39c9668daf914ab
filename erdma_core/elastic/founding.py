"""The first epoch of an elastic job whose store has no server (``dht://``): written by the job's creator.

The members decide each epoch's record, but the first has no members before it to decide it. So the process
that makes the job (``erdma run --elastic --store dht://...``, or a caller of ``found``) writes it: it puts the
job's ``min_peers`` on the bulletin, waits until that many peers have drawn tickets, and puts the record of
epoch 1 (those peers, the first holding the state) and their admissions there. It is the only writer of these
keys, so every peer reads the same record. A peer whose ticket a racing draw shared finds itself missing
from the record and draws again, to be admitted at a later boundary by the members.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import CollectiveTimeoutError
from .membership import Keys, Record, founders

POLL_S = 0.2


def found(bulletin: Any, job: str, min_peers: int, timeout: float) -> Record:
    """Write job ``job``'s ``min_peers`` and, once that many peers drew tickets, its first epoch's record and
    their admissions on ``bulletin`` (a discovery store: set, get, add). CollectiveTimeoutError after
    ``timeout`` seconds without ``min_peers`` tickets."""
    keys = Keys(job)
    bulletin.set(keys("min_peers"), str(min_peers).encode())
    deadline = time.monotonic() + timeout
    while (drawn := int(bulletin.add(keys("tickets"), 0))) < min_peers:
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(f"elastic: job {job!r} did not reach {min_peers} peers within {timeout:.0f}s "
                                         f"({drawn} drew tickets)", op="join")
        time.sleep(POLL_S)
    record = Record(1, founders(bulletin, keys, drawn), drawn, int(bulletin.add(keys("probes"), 0)))
    bulletin.set(keys("epoch", 1), record.encode())
    for t in range(1, drawn + 1):
        bulletin.set(keys("admit", t), b"1")
    return record
