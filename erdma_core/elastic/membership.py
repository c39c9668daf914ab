"""Membership of an elastic job, agreed through the job's store with no master: tickets for newcomers, epoch
records, and the ballot every member casts after each step it takes with the others.

Keys live under ``erdma/elastic/<job>/``. A newcomer draws a ticket (``add("tickets")``) and publishes who it
is under it. An epoch's record (``epoch/<e>``: its members in rank order, which of them hold the shared state,
and how many tickets it has admitted) is written with ``compare_set`` from empty, so whoever proposes first
wins and everyone reads the same record.

A *ballot* decides one step of an epoch (state transfer, an allreduce): each member sets its own vote with
``compare_set`` (``done`` or ``fail``); a member that sees a peer's connection drop, or waits past the
deadline, sets that peer's vote to ``dead`` the same way. Votes are final, so the outcome is too: *commit*
when every vote is ``done``, else *abort*. The last ``done`` vote (a counter reaching the epoch's size)
writes the outcome, with the number of tickets drawn by then (the newcomers the next boundary admits); a
``fail`` or ``dead`` vote writes *abort*. After an abort the survivors are the members whose vote is not
``dead``: every member reads the same votes, so they agree on the next epoch without another round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import CollectiveTimeoutError, ConfigError, ErdmaError

DONE, FAIL, DEAD = b"done", b"fail", b"dead"
POLL_S = 0.05  # how often a waiting member looks at its transport for a lost peer
SCAN_S = 1.0  # how often it reads every vote (a member that voted and died before counting itself)
PREFER_S = 0.5  # on a store where every member sees every vote (``commits_first``): how long the others leave
# the commit to member 0 once they see every vote done (several proposing it at once would duel)


class CasStore(Protocol):
    """The store calls an elastic group makes (``erdma_core.discovery.Store`` with ``compare_set``)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes: ...

    def close(self) -> None: ...


class ExcludedError(ErdmaError):
    """This peer was counted as dead by the others (it answered too late): it has to join again."""


class JobFinishedError(ErdmaError):
    """The elastic job finished (``ElasticGroup.finish``) before this peer was admitted."""


@dataclass(frozen=True)
class Member:
    id: str  # drawn by the peer at start, unique
    name: str  # for people: host:pid
    has_state: bool  # holds the job's shared state (newcomers do not, until a transfer commits)


@dataclass(frozen=True)
class Record:
    epoch: int
    members: tuple[Member, ...]
    admitted: int  # tickets admitted so far (newcomers with a higher ticket wait)
    probes: int = 0  # newcomers' path checks asked for before it was proposed (``admission``): a later one that
    # names its members is answered by every one of them, the ones it takes in too

    def encode(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "admitted": self.admitted, "probes": self.probes,
                           "members": [[m.id, m.name, m.has_state] for m in self.members]}).encode()

    @staticmethod
    def decode(raw: bytes) -> Record:
        try:
            d = json.loads(raw)
            return Record(int(d["epoch"]), tuple(Member(str(i), str(n), bool(s)) for i, n, s in d["members"]),
                          int(d["admitted"]), int(d.get("probes", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ErdmaError(f"elastic: an epoch record in the store is malformed: {exc}") from None

    def index(self, peer: str) -> int | None:
        return next((i for i, m in enumerate(self.members) if m.id == peer), None)

    def complete(self) -> bool:
        """Whether every member holds the shared state (no newcomer waits for it)."""
        return all(m.has_state for m in self.members)


@dataclass(frozen=True)
class Outcome:
    commit: bool
    tickets: int  # tickets drawn when the step committed (0 on abort)
    survivors: tuple[int, ...]  # on abort: the members (indices) whose vote is not dead
    moved: int = 0  # on commit: how many times members of the epoch said their paths moved (``Ballot.moved``)
    probes: int = 0  # on commit: newcomers' path checks asked for so far (``admission``)


class Keys:
    def __init__(self, job: str) -> None:
        self.job = job
        self.base = f"erdma/elastic/{job}/"

    def __call__(self, *parts: object) -> str:
        return self.base + "/".join(str(p) for p in parts)


def need_compare_set(store: object) -> None:
    if not callable(getattr(store, "compare_set", None)):
        raise ConfigError(f"elastic groups need a store with compare_set; {type(store).__name__} has none "
                          "(discovery.init_method: env://, tcp:// or file:// give one)")


def finished_step(store: CasStore, keys: Keys) -> int | None:
    """The step at which the job finished (``ElasticGroup.finish``), or None while it runs (a look, no wait)."""
    try:
        return int(store.get(keys("finished"), 0.0))
    except CollectiveTimeoutError:
        return None


def job_min_peers(store: CasStore, keys: Keys, mine: int, given: bool) -> int:
    """The job's ``elastic.min_peers``: the first value written (by ``erdma run --elastic`` as it makes the job,
    else by the first peer to join), so that every peer counts the same tickets before the job starts. A peer
    that was given another value is refused (ConfigError naming both); one left at the default follows the
    job's."""
    job = int(store.compare_set(keys("min_peers"), b"", str(mine).encode()))
    if given and job != mine:
        raise ConfigError(f"config key 'elastic.min_peers': {mine} differs from job {keys.job!r}'s, {job} (set when "
                          f"the job was made); valid: {job}, or leave it unset to follow the job's")
    return job


def newcomers(store: Any, keys: Keys, first_after: int, upto: int) -> tuple[Member, ...]:
    """The peers that drew tickets ``first_after+1..upto`` and said who they are (a ticket whose peer went
    before saying so is skipped)."""
    found = []
    for t in range(first_after + 1, upto + 1):
        try:
            pid, name = store.get(keys("ticket", t), 5.0).decode().split(" ", 1)
        except CollectiveTimeoutError:
            continue
        found.append(Member(pid, name, False))
    return tuple(found)


def founders(store: Any, keys: Keys, drawn: int) -> tuple[Member, ...]:
    """The job's first members: the peers of tickets 1..``drawn``, the first holding the state it gives the
    others."""
    first = newcomers(store, keys, 0, drawn)
    return (Member(first[0].id, first[0].name, True), *first[1:]) if first else ()


def propose(store: CasStore, keys: Keys, epoch: int, members: tuple[Member, ...], admitted: int) -> Record:
    """Write the record of ``epoch`` unless someone did first; the epoch's record either way. It counts the
    path checks asked for before it was written, so each of its members answers every one asked later."""
    record = Record(epoch, members, admitted, store.add(keys("probes"), 0))
    return Record.decode(store.compare_set(keys("epoch", epoch), b"", record.encode()))


class Ballot:
    """One step of epoch ``epoch`` (``step``: its number within the epoch), for member ``index`` of ``size``."""

    def __init__(self, store: CasStore, keys: Keys, epoch: int, step: int, index: int, size: int) -> None:
        self.store, self.index, self.size = store, index, size
        self._key = lambda *p: keys("vote", epoch, step, *p)
        self._tickets = keys("tickets")
        self._moved = keys("moved", epoch)
        self._probes = keys("probes")
        self._defers = bool(getattr(store, "commits_first", False)) and index != 0  # to member 0
        self._done_at: float | None = None  # when this member first saw every vote done (``_look``)

    def _vote(self, member: int, value: bytes) -> bytes:
        return self.store.compare_set(self._key(member), b"", value)

    def _settle(self, value: bytes) -> None:
        self.store.compare_set(self._key("outcome"), b"", value)

    def _commit(self) -> None:
        """Every vote is done: commit, with the tickets drawn by now (the newcomers the next boundary admits),
        the epoch's count of moved paths (``moved``: a member says so before it votes, so the count holds
        every member's word for this step) and the newcomers' path checks asked for by now (``admission``)."""
        self._settle(b"commit:%d:%d:%d" % (self.store.add(self._tickets, 0), self.store.add(self._moved, 0),
                                           self.store.add(self._probes, 0)))

    def moved(self) -> None:
        """Before this member votes done: its transport's paths moved since the epoch last agreed on them, so
        the members agree again (``ProcessGroup.agree_paths``) after the step this ballot commits."""
        self.store.add(self._moved, 1)

    def _read(self, member: int) -> bytes:
        try:
            return self.store.get(self._key(member), 0.0)
        except CollectiveTimeoutError:
            return b""

    def aborted(self) -> bool:
        """Whether a vote has already settled this step as aborted (a look, no waiting)."""
        try:
            return self.store.get(self._key("outcome"), 0.0) == b"abort"
        except CollectiveTimeoutError:
            return False

    def leave(self) -> None:
        """Vote this member dead before it goes, so that the others need not wait to find out."""
        self._vote(self.index, DEAD)

    def decide(self, ok: bool, lost: Callable[[], set[int]], deadline: float, settle_s: float) -> Outcome:
        """Cast this member's vote and wait for the outcome. ``lost()``: members this one's transport saw
        go; ``deadline``: when members that have not voted count as dead; ``settle_s``: after an abort, how
        long members that have not voted get before they count as dead."""
        if self._vote(self.index, DONE if ok else FAIL) == DEAD:
            raise ExcludedError(f"elastic: member {self.index} was counted as dead before it voted")
        if not ok:
            self._settle(b"abort")
        elif self.store.add(self._key("count"), 1) == self.size and not self._defers:
            self._commit()
        scan_s = getattr(self.store, "scan_s", SCAN_S)  # (a store whose reads of votes are local looks sooner)
        scan = time.monotonic() + scan_s
        while True:
            try:
                out = self.store.get(self._key("outcome"), POLL_S)
                break
            except CollectiveTimeoutError:
                pass
            now = time.monotonic()
            gone = lost()
            if gone or now > scan or now > deadline:
                scan = now + scan_s
                self._look(gone, now > deadline)
        if out.startswith(b"commit:"):
            tickets, moved, probes = (int(x) for x in out[7:].split(b":"))
            return Outcome(True, tickets, (), moved, probes)
        end = time.monotonic() + settle_s
        while True:
            votes = [self._read(m) for m in range(self.size)]
            missing = [m for m, v in enumerate(votes) if not v]
            if not missing:
                return Outcome(False, 0, tuple(m for m, v in enumerate(votes) if v != DEAD))
            gone = lost()
            late = time.monotonic() > end
            for m in missing:
                if m in gone or late:
                    self._vote(m, DEAD)
            if not late and not gone & set(missing):
                try:  # wakes as soon as that member votes
                    self.store.get(self._key(missing[0]), POLL_S)
                except CollectiveTimeoutError:
                    pass

    def _look(self, gone: set[int], late: bool) -> None:
        """Read every vote; count the lost (or, past the deadline, every silent) member dead; write the
        outcome when the votes decide it."""
        votes = [self._read(m) for m in range(self.size)]
        for m, v in enumerate(votes):
            if not v and (m in gone or late):
                votes[m] = self._vote(m, DEAD)
        if any(v in (FAIL, DEAD) for v in votes):
            self._settle(b"abort")
        elif all(v == DONE for v in votes):
            now = time.monotonic()
            self._done_at = now if self._done_at is None else self._done_at
            if not self._defers or now - self._done_at >= PREFER_S:  # member 0 commits; the others once it
                self._commit()  # has not for PREFER_S (it died, or stopped, after it voted)
