"""The first epoch of an elastic job whose store has no server (``dht://``): written by the job's creator.

The members decide each epoch's record, but the first has no members before it to decide it. So the process
that makes the job (``erdma run --elastic --store dht://...``, or a caller of ``found``) writes it: it puts the
job's ``min_peers`` on the bulletin, waits until that many peers have drawn tickets and said who they are (a
ticket is counted before its peer's name is on the bulletin), and puts the record of epoch 1 (those peers, the
first holding the state) and their admissions there. Two peers whose racing draws got one ticket number are
counted both and named once: once ``min_peers`` tickets are counted, names that stay missing for ``SETTLE_S``
are a race's, and the job is founded with the peers named. It is the only writer of these
keys, so every peer reads the same record. A peer whose ticket a racing draw shared finds itself missing
from the record and draws again, to be admitted at a later boundary by the members.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import CollectiveTimeoutError
from .membership import Keys, Member, Record

POLL_S = 0.2
NAME_S = 0.5  # how long one look waits for a ticket's name
SETTLE_S = 5.0  # how long names may stay missing once min_peers tickets are counted


def found(bulletin: Any, job: str, min_peers: int, timeout: float) -> Record:
    """Write job ``job``'s ``min_peers`` and, once that many peers drew tickets, its first epoch's record and
    their admissions on ``bulletin`` (a discovery store: set, get, add). CollectiveTimeoutError after
    ``timeout`` seconds without ``min_peers`` tickets."""
    keys = Keys(job)
    bulletin.set(keys("min_peers"), str(min_peers).encode())
    deadline = time.monotonic() + timeout
    named: dict[int, Member] = {}
    counted_at: float | None = None  # when min_peers tickets were first counted
    while True:
        drawn = int(bulletin.add(keys("tickets"), 0))
        for t in range(1, drawn + 1):
            if t not in named:
                try:
                    pid, name = bulletin.get(keys("ticket", t), NAME_S).decode().split(" ", 1)
                except CollectiveTimeoutError:
                    continue
                named[t] = Member(pid, name, False)
        first = list({m.id: m for _, m in sorted(named.items())}.values())  # (a peer named twice: its first)
        if drawn >= min_peers and counted_at is None:
            counted_at = time.monotonic()
        if len(first) >= min_peers or (first and counted_at is not None and time.monotonic() - counted_at > SETTLE_S):
            break
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(f"elastic: job {job!r} did not reach {min_peers} peers within {timeout:.0f}s "
                                         f"({drawn} drew tickets, {len(first)} said who they are)", op="join")
        time.sleep(POLL_S)
    members = (Member(first[0].id, first[0].name, True), *first[1:])
    record = Record(1, members, drawn, int(bulletin.add(keys("probes"), 0)))
    bulletin.set(keys("epoch", 1), record.encode())
    for t in range(1, drawn + 1):
        bulletin.set(keys("admit", t), b"1")
    return record
