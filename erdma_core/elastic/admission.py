"""A newcomer's paths, checked before it is put into an epoch (``elastic.admission_check``), so that one that
cannot reach the members costs them nothing.

Before it draws a ticket, a newcomer asks for a check (``probes`` counts the requests; ``probe/<n>`` says who
asks, and of which members of the latest epoch). The members learn of it from the commit of their next step,
which carries the count (``Ballot``), so each member sees it at the same step, from its own ballot, with no
extra reads. Each member named then answers on a thread of its own, while it goes on stepping: it sets
``probe/<n>/<member>/start`` and sets up a group of two with the newcomer (the member rank 0, the newcomer rank
1, as in the epoch that would take it in), through the job's configured transport and traversal, under the
request's keys, and runs one allreduce of a single number on it. The newcomer does the same with every member
that started. A pair whose group does not come up within ``timeouts.connect`` (``UnreachableError``) is a pair
the epoch would not connect either. A member that does not start within ``START_S`` of the first, or that
leaves the latest epoch while its pair is checked (it died: the members formed an epoch without it), is left
out; so is a member whose check was called off because the newcomer was done with the request.
A request no member started answering within ``ASK_AGAIN_S``, or that another newcomer's replaced (a store with no
server can give one number twice, and lose part of its count: a number at or below the latest record's count is
drawn again above it), is asked again under a new number.
The newcomer draws a ticket only when no pair failed; otherwise it says which pairs, in one line, and checks
again later (5 s, then twice as long each time, at most 60 s), until ``elastic.join_timeout``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import Config
from ..errors import CollectiveTimeoutError, ErdmaError, UnreachableError
from .membership import CasStore, Keys, Member, Record, finished_step
from .prefix import PrefixStore

log = logging.getLogger("erdma.elastic")
FIRST_WAIT_S = 5.0  # before a newcomer checks again; doubled each time
LONGEST_WAIT_S = 60.0
READ_S = 5.0  # how long a member waits for a request's record after the count that names it
START_S = 5.0  # after the first member started answering, how long the others have to start (they all see the
# request at the commit of the same step)
LOOK_S = 1.0  # how often a newcomer reads the latest epoch while it checks (whether a member left it)
ASK_AGAIN_S = 10.0  # a request no member started answering by then is asked again, under a new number


@dataclass(frozen=True)
class Verdict:
    unreachable: tuple[str, ...]  # names of the members no connection was made with
    checked: int  # members that took part
    unanswered: bool = False  # no member started answering (ask again)


def latest(store: CasStore, keys: Keys) -> Record | None:
    """The latest epoch's record in the store, or None before the job started. From the hint ``epoch/latest``
    where a store keeps one (the peer store: a DHT loses old records, so the epochs it holds have gaps), else
    by doubling, then halving (a few reads however many epochs there were); then on while the next is there."""
    def has(epoch: int) -> bool:
        try:
            store.get(keys("epoch", epoch), 0.0)
            return True
        except CollectiveTimeoutError:
            return False

    try:
        low = int(store.get(keys("epoch", "latest"), 0.0))
    except (CollectiveTimeoutError, ValueError):
        low = 0
    if low < 1 or not has(low):
        if not has(1):
            return None
        low, high = 1, 2
        while has(high):
            low, high = high, high * 2
        while high - low > 1:  # has(low), not has(high)
            mid = (low + high) // 2
            low, high = (mid, high) if has(mid) else (low, mid)
    while has(low + 1):
        low += 1
    return Record.decode(store.get(keys("epoch", low), 0.0))


def check(store: CasStore, open_client: Callable[[], Any], conf: Config, keys: Keys, me: str, name: str,
          deadline: float, finished: Callable[[], None]) -> Verdict:
    """The newcomer's side: ask the latest epoch's members to check the paths to them, and check them. Waits
    until the first member starts (at most until ``deadline``; ``finished()`` raises once the job finished),
    then ``timeouts.connect`` for the rest of them to start and for every pair's group."""
    record = latest(store, keys)
    if record is None:
        return Verdict((), 0)
    n = store.add(keys("probes"), 1)
    if n <= record.probes:  # a count a store with no server lost part of: the members are past this number
        n = store.add(keys("probes"), record.probes + 1 - n)
    asked = json.dumps({"id": me, "name": name, "members": [m.id for m in record.members]}).encode()
    store.set(keys("probe", n), asked)
    try:
        started = _first_start(store, keys, n, asked, record, min(deadline, time.monotonic() + ASK_AGAIN_S),
                               finished)
        if started is None:
            log.info("elastic: no member started on path check %d within %.0fs: asking again", n, ASK_AGAIN_S)
            return Verdict((), 0, unanswered=time.monotonic() < deadline)
        results: dict[str, BaseException | None] = {}
        current = _Current(store, keys, record)
        threads = [threading.Thread(target=_pair, args=(open_client, conf, keys, n, m.id, 1, started + START_S,
                                                        results, current.left(m)),
                                    name="erdma-elastic-check", daemon=True)
                   for m in record.members]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        store.set(keys("probe", n, "closed"), b"1")  # a member that comes to it later does not answer
    failed = tuple(m.name for m in record.members if isinstance(results.get(m.id), UnreachableError))
    worked = sum(1 for m in record.members if m.id in results and results[m.id] is None)
    return Verdict(failed, worked + len(failed))


class _Current:
    """The latest epoch, and whether the job finished, read again at most every ``LOOK_S`` by whichever pair's
    check asks (thread-safe)."""

    def __init__(self, store: CasStore, keys: Keys, record: Record) -> None:
        self._store, self._keys, self._record = store, keys, record
        self._read = time.monotonic()
        self._finished: str | None = None
        self._lock = threading.Lock()

    def left(self, member: Member) -> Callable[[], str | None]:
        """For a pair's set-up: why to stop it (``member`` is not in the latest epoch: it died; or the job
        finished: the member went without a word), or None."""
        def why() -> str | None:
            with self._lock:
                if time.monotonic() - self._read >= LOOK_S:
                    self._read = time.monotonic()
                    try:
                        self._record = latest(self._store, self._keys) or self._record
                        step = finished_step(self._store, self._keys)
                    except ErdmaError:
                        step = None
                    if step is not None:
                        self._finished = f"the job finished at step {step}"
                gone = self._record.index(member.id) is None
            if self._finished is not None:
                return self._finished
            return f"{member.name} is no longer a member (epoch {self._record.epoch})" if gone else None
        return why


def _first_start(store: CasStore, keys: Keys, n: int, asked: bytes, record: Record, until: float,
                 finished: Callable[[], None]) -> float | None:
    """Wait until a member of ``record`` starts answering request ``n`` (at its next committed step); the time
    it did, or None at ``until`` or once request ``n`` is no longer ``asked`` (another newcomer drew the same
    number from a store with no server, whose counter can give one twice, and its request replaced this one)."""
    while time.monotonic() < until:
        for m in record.members:
            try:
                store.get(keys("probe", n, m.id, "start"), 0.0)
                return time.monotonic()
            except CollectiveTimeoutError:
                pass
        finished()
        try:
            if store.get(keys("probe", n), 0.0) != asked:
                return None
        except CollectiveTimeoutError:
            pass
        time.sleep(0.5)
    return None


def answer(open_client: Callable[[], Any], conf: Config, keys: Keys, n: int, me: str) -> None:
    """A member's side, on a thread of its own: request ``n``, if it names this member and is still open, is
    answered with a group of two with the newcomer. Whatever happens is logged, never raised: the member's
    steps do not depend on it."""
    try:
        client = open_client()
    except ErdmaError as exc:
        log.info("elastic: a newcomer's path check %d not answered: %s", n, exc)
        return
    try:
        asked = json.loads(client.get(keys("probe", n), READ_S))
        if me not in asked.get("members", ()) or _closed(client, keys, n) is not None:
            client.close()
            return
        client.set(keys("probe", n, me, "start"), b"1")
    except (ErdmaError, ValueError, AttributeError) as exc:
        log.info("elastic: a newcomer's path check %d not answered: %s", n, exc)
        client.close()
        return
    results: dict[str, BaseException | None] = {}  # (_pair closes the client)
    _pair(lambda: client, conf, keys, n, me, 0, 0.0, results, lambda: _closed(client, keys, n))
    outcome = results.get(me)
    if outcome is None:
        log.info("elastic: %s's paths to this member checked: they connect", asked.get("name", "a newcomer"))
    else:
        log.warning("elastic: %s cannot reach this member: %s", asked.get("name", "a newcomer"), outcome)


def _closed(client: Any, keys: Keys, n: int) -> str | None:
    try:
        client.get(keys("probe", n, "closed"), 0.0)
        return "the newcomer is done with this check"
    except CollectiveTimeoutError:
        return None


def _pair(open_client: Callable[[], Any], conf: Config, keys: Keys, n: int, member: str, rank: int,
          until: float, results: dict[str, BaseException | None], called_off: Callable[[], str | None]) -> None:
    """One pair's check, as ``rank`` (0: the member, 1: the newcomer): a group of two under the request's keys
    for ``member``, and an allreduce of one number on it; ``results[member]`` is None when it worked, else the
    error. The newcomer's side first waits (until ``until``) for the member to start. ``called_off()``: why
    to stop the set-up (``PrefixStore``), or None."""
    from ..api.join import init_with_store

    try:
        client = open_client()
    except ErdmaError as exc:
        results[member] = exc
        return
    try:
        if rank == 1:
            client.get(keys("probe", n, member, "start"), max(0.0, until - time.monotonic()))
        prefix = PrefixStore(client, keys("probe", n, member) + "/", called_off)
        pg = init_with_store(prefix, rank, 2, conf, default=False)
        prefix.settle()
        try:
            one = np.ones(1, np.float32)
            pg.allreduce(one)
            if one[0] != 2.0:
                raise ErdmaError(f"elastic: a path check's allreduce gave {one[0]!r}, not 2.0")
        finally:
            pg.destroy()
        results[member] = None
    except ErdmaError as exc:  # UnreachableError: no path; CollectiveTimeoutError: it never started; AbortedError:
        # called off
        results[member] = exc
    finally:
        client.close()
