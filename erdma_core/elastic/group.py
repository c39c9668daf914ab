"""``ElasticGroup``: a group whose members change while the job runs (``erdma_core.elastic``).

Each membership is an *epoch* with a ``ProcessGroup`` of its own (its store keys under the epoch's prefix).
Steps taken together (a state transfer, an allreduce) end in a ballot (``membership``): committed everywhere
or aborted everywhere. An aborted allreduce is rolled back (each member's input restored) and run again among
the survivors, who form the next epoch from the votes alone. Newcomers wait with a ticket; a committed step
admits those who drew one before it, at the next ``sync()``, where they receive the state and check it.

A member lost while the others are between calls (computing their inner steps) is not left for the next
call to find: each survivor's beat thread sees the loss (a lapse, or its epoch's transport failed) and, on a
thread of its own, votes the next step failed and sets up the survivors' epoch then, so that the epoch is up
when the caller comes back (``_ahead``). The caller's next call waits for that thread and goes on from the
epoch it made.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..api.join import init_with_store
from ..api.process_group import ProcessGroup
from ..config import Config
from ..errors import (
    AbortedError,
    AuthenticationError,
    CollectiveTimeoutError,
    ConfigError,
    ErdmaError,
    PeerLostError,
    UnreachableError,
)
from ..protocol.reduce_ops import ReduceOp
from . import admission
from . import state as shared
from .liveness import Liveness
from .membership import (
    Ballot,
    CasStore,
    ExcludedError,
    JobFinishedError,
    Keys,
    Member,
    Outcome,
    Record,
    finished_step,
    founders,
    job_min_peers,
    need_compare_set,
    newcomers,
    propose,
)
from .prefix import PrefixStore

log = logging.getLogger("erdma.elastic")
SETTLE_S = 5.0  # after an abort, how long a member that has not voted has before it counts as dead
CLOSE_WAIT_S = 1.0  # how long the next epoch's set-up waits for the old group to close (and give its sockets back)
RETRIED = (PeerLostError, CollectiveTimeoutError, AbortedError)  # failures a change of membership explains


class ElasticGroup:
    """Members of job ``job`` that share ``state`` (name -> numpy array or CPU tensor, the same names, dtypes
    and shapes on every peer). Made by ``erdma_core.elastic.join``; see its docstring for the loop."""

    def __init__(self, store: CasStore, conf: Config, job: str, state: Mapping[str, Any], *, min_peers: int,
                 join_timeout: float, announce: bool, beats: CasStore | None = None,
                 clients: Callable[[], CasStore] | None = None) -> None:
        """``beats``: a client of the same store of its own, for the members' signs of life
        (``elastic.liveness_timeout``; ``liveness``); None: a hung member is found at the collective's
        timeout. ``clients()``: a new client of the store, one per path check of a newcomer (``admission``,
        with ``elastic.admission_check``); None: no checks."""
        need_compare_set(store)
        for name in state:
            shared.view(state[name])  # refuses what it cannot share
        self.store, self.conf, self.state = store, conf, dict(state)
        self.keys = Keys(job)
        self.id = getattr(store, "member_id", None) or secrets.token_hex(8)  # (a store of the peers' own names it)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.step = 0  # the caller's outer step; travels with the state and is part of its hash
        self.min_peers, self.join_timeout, self.announce = min_peers, join_timeout, announce
        self.record: Record | None = None
        self._pg: ProcessGroup | None = None
        self._ahead_thread: threading.Thread | None = None  # recovering ahead of the caller (``_ahead``)
        self._op = 0  # ballots cast in this epoch
        self._admit = 0  # tickets the last committed step said to admit
        self.counters = {"epochs": 0, "aborted": 0, "admitted": 0, "lost": 0, "rejoined": 0}
        self.setup_s = 0.0  # how long the last epoch's ProcessGroup took to set up
        self._was_up = False  # whether an epoch's group of this peer's ever came up
        self._left = 0  # the latest epoch this peer was counted out of: it is admitted only to a later one
        self._moved = 0  # the epoch's count of moved paths its last committed allreduce said (``Ballot.moved``)
        self._slow: set[int] = set()  # the peers this one reached through a relay when the epoch last agreed
        self._clients = clients
        self._probes: int | None = None  # newcomers' path checks this member has seen asked for (``admission``)
        self._calls = threading.Lock()  # held by a caller's call, or by the thread that recovers ahead of it
        self._ahead_error: Exception | None = None  # what recovering ahead of the caller ended with
        self.liveness = None if beats is None else Liveness(beats, self.keys, self.id,
                                                            conf["elastic.liveness_timeout"])

    # ---- the caller's API ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.record.epoch if self.record else 0

    @property
    def pg(self) -> ProcessGroup | None:
        """The current epoch's ProcessGroup (None between epochs). While the members form an epoch ahead of
        the caller (a member was lost between calls), this waits until it is up."""
        thread = self._ahead_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        return self._pg

    def rank(self) -> int:
        index = self.record.index(self.id) if self.record else None
        if index is None:
            raise ExcludedError("elastic: this peer is not a member now")
        return index

    def size(self) -> int:
        return len(self.record.members) if self.record else 0

    def members(self) -> list[str]:
        return [m.name for m in self.record.members] if self.record else []

    def state_hash(self) -> str:
        return shared.state_hash(self.state, self.step).hex()

    def sync(self) -> None:
        """A step boundary: admit the newcomers the last committed step counted (they receive the state and
        check its hash). Every member calls it at the same point of its loop."""
        with self._calls:
            try:
                self._caught_up()
                if self.record is None:
                    self._join()
                    return
                while self._admit > self.record.admitted or not self.record.complete():
                    if self._admit > self.record.admitted:
                        # the epoch this proposes may lose to the survivors' of a loss another member saw
                        # ahead: then this member enters theirs and proposes the admission after it
                        old = self.record
                        self._enter(propose(self.store, self.keys, old.epoch + 1,
                                            old.members + self._newcomers(old.admitted, self._admit),
                                            self._admit), old)
                    if not self.record.complete():
                        self._transfer()
            except ExcludedError:
                self._rejoin()

    def allreduce(self, x: Any, op: ReduceOp | str = ReduceOp.AVG) -> int:
        """Reduce ``x`` in place over the members. A member lost meanwhile makes every survivor restore its
        input and run it again among the survivors, so the result is the same on each and over exactly the
        members that count returns. 0: this peer was counted out and has rejoined as a newcomer, with the
        members' state (``x`` is restored; start the step again)."""
        buf = shared.view(x)
        with self._calls:
            try:
                self._caught_up()
            except ExcludedError:
                self._rejoin()
                return 0
            return self._allreduce(x, buf, op)

    def _allreduce(self, x: Any, buf: Any, op: ReduceOp | str) -> int:
        backup = buf.copy()
        while True:
            assert self._pg is not None
            error: BaseException | None = None
            try:
                self._ready()
                self._pg.allreduce(x, op=op)
            except ErdmaError as exc:
                error = exc
            try:
                outcome = self._decide(error)
                if outcome.commit:
                    self._admit = max(self._admit, outcome.tickets)
                    if outcome.moved > self._moved:  # every member reads the same commit: all agree here
                        self._moved = outcome.moved
                        self._agree_paths()
                    return self.size()
                buf[...] = backup
                self._recover(outcome, error)
            except ExcludedError:
                buf[...] = backup
                self._rejoin()
                return 0

    def finish(self) -> None:
        """The job is done: peers still waiting to be admitted get ``JobFinishedError``; this peer leaves."""
        self.store.set(self.keys("finished"), str(self.step).encode())
        self.leave()

    def leave(self) -> None:
        """Leave the job: the others go on without waiting to find out."""
        with self._calls:
            try:
                self._caught_up()
            except ErdmaError:  # counted out, or failed, ahead of the call: leaving is all that is left
                pass
            self._leave()

    def _leave(self) -> None:
        if self.record is not None and self._pg is not None:
            try:
                Ballot(self.store, self.keys, self.epoch, self._op, self.rank(), self.size()).leave()
            except ErdmaError:
                pass
        self._drop_pg()
        self.record = None
        if self.liveness is not None:
            self.liveness.close()
            self.liveness = None

    # ---- epochs ------------------------------------------------------------------------------------------
    def _ready(self) -> None:
        """Fail at once when the epoch's transport already lost a peer (its next collective cannot finish)."""
        failure = self._pg.failure() if self._pg else None
        if failure is not None:
            raise failure

    def _lost(self) -> set[int]:
        """Members this one knows are gone: the one its transport saw go, those whose beats lapsed."""
        failure = self._pg.failure() if self._pg else None
        gone = {failure.peer} if isinstance(failure, PeerLostError) else set()
        if self.liveness is not None and self.record is not None and self._judges(self.record):
            gone |= {i for i, m in enumerate(self.record.members) if m.id in self.liveness.lapsed()}
        return gone

    def _judges(self, record: Record) -> bool:
        """Whether this member acts on the others' lapsed signs of life in ``record``'s epoch: only once it holds
        the state. A newcomer that has not heard a member yet (its connections to the members are new, on a
        busy machine its first signs may come late) would otherwise count out a member the holders hear, and
        call off the epoch that admits it, again and again; the holders judge, and a newcomer goes on with
        whom they keep (as its ballot never counts a late member dead, ``_decide``)."""
        index = record.index(self.id)
        return index is not None and record.members[index].has_state

    def _lapse(self) -> None:
        """A member's beats lapsed (the beat thread): end the collective waiting on it now (unless this peer
        has gone on to an epoch without it meanwhile, or does not judge yet). Between the caller's calls, the
        same round's ``_ahead`` then recovers ahead of it."""
        pg, record, liveness = self._pg, self.record, self.liveness
        if pg is None or record is None or liveness is None or not self._judges(record):
            return
        lapsed = [i for i, m in enumerate(record.members) if m.id in liveness.lapsed()]
        if lapsed:  # (named: neither the word to the peers nor the close waits on them; the ballot judges)
            names = ", ".join(record.members[i].name for i in lapsed)
            pg.abort(gone=lapsed, why=f"no sign of {names} for {liveness.timeout:.1f} s")

    def _ahead(self) -> None:
        """The beat thread, after each round: when the epoch's group failed (a member lapsed, its transport
        lost a peer, a peer aborted) while the caller is between calls, vote the next step failed and form
        the survivors' epoch now, on a thread of its own, rather than when the caller next calls. Every
        survivor does the same, so the new epoch's set-up runs while the callers compute; a survivor inside
        a call recovers there, in the same ballot. Nothing happens while a call (or this) holds the group."""
        pg = self._pg
        if pg is None or pg.failure() is None or not self._calls.acquire(blocking=False):
            return
        record = self.record
        if self._pg is not pg or self._ahead_error is not None or record is None or not record.complete() \
                or self._admit > record.admitted:
            # a call moved on meanwhile, or one is owed; or the next call is a boundary that admits newcomers
            # (its new epoch's set-up finds the loss, on every member alike), not a step's ballot
            self._calls.release()
            return
        try:
            self._ahead_thread = threading.Thread(target=self._recover_ahead, name="erdma-elastic-ahead",
                                                  daemon=True)
            self._ahead_thread.start()
        except RuntimeError:  # no thread to be had: the caller's next call recovers, as without this
            self._ahead_thread = None
            self._calls.release()

    def _recover_ahead(self) -> None:
        """``_ahead``'s thread (holding ``_calls``): the ballot the caller's next call would have cast with the
        group's failure, and the recovery it would have made. What ends it (counted out, a failure no loss
        explains) is raised at the caller's next call."""
        try:
            failure = self._pg.failure() if self._pg is not None else None
            if failure is not None:
                log.info("elastic: epoch %d lost a member between steps (%s): forming the next epoch ahead of "
                         "the caller", self.epoch, failure)
                self._recover(self._decide(failure), failure)
        except Exception as exc:  # the caller gets it, not a dying thread
            self._ahead_error = exc
        finally:
            self._calls.release()

    def _caught_up(self) -> None:
        """At a call (holding ``_calls``): raise what recovering ahead of it ended with, if anything."""
        error, self._ahead_error = self._ahead_error, None
        if error is not None:
            raise error

    def _decide(self, error: BaseException | None, retry: bool | None = None) -> Outcome:
        """The ballot on the step just taken. A failure that no membership change explains (a mismatch, a
        protocol error) is raised here after this member votes itself out, so that the others go on without
        it rather than try again forever."""
        assert self.record is not None
        ballot = Ballot(self.store, self.keys, self.epoch, self._op, self.rank(), self.size())
        self._op += 1
        if error is None and self._pg is not None and (slow := self._pg.slow_peers()) != self._slow:
            self._slow = slow  # a relayed path went direct, or the other way: said before the vote counts
            ballot.moved()
        if error is not None and not (isinstance(error, RETRIED) if retry is None else retry):
            ballot.leave()
            raise error
        # a member without the state (a newcomer) never counts a silent member dead for being late, only for
        # being lost: it cannot tell a slow member from a dead one, and the state it would go on without is the
        # job's; the members that hold it count it out instead if it is the one that went
        has = self.record.members[self.rank()].has_state
        deadline = time.monotonic() + self.conf["timeouts.collective"]
        outcome = ballot.decide(error is None, self._lost, deadline, SETTLE_S if has else self.conf["timeouts.collective"])
        if outcome.commit:
            self._answer(outcome.probes)
        return outcome

    def _answer(self, probes: int) -> None:
        """The path checks newcomers asked for since this member's last commit: each on a thread of its own
        (``admission.answer``). A peer counts from the record that took it in (``Record.probes``): every
        check asked after that record was written may name it."""
        seen, self._probes = self._probes, probes
        if seen is None or self._clients is None:
            return
        for n in range(seen + 1, probes + 1):
            threading.Thread(target=admission.answer, args=(self._clients, self.conf, self.keys, n, self.id),
                             name="erdma-elastic-answer", daemon=True).start()

    def _recover(self, outcome: Outcome, error: BaseException | None) -> None:
        """After an abort: the next epoch is the survivors (the votes say who, less the peer this member's
        transport saw go), with the state flags they had. The first proposal written is everyone's."""
        assert self.record is not None
        old = self.record
        self.counters["aborted"] += 1
        gone = self._lost()
        alive = [i for i in outcome.survivors if i not in gone]
        if not any(old.members[i].has_state for i in alive):  # of the members holding the state, keep those
            alive = list(outcome.survivors)  # whose vote says they are there, whatever a connection said
        self.counters["lost"] += len(old.members) - len(alive)
        if self.rank() not in alive:
            raise ExcludedError("elastic: counted as dead")
        members = tuple(old.members[i] for i in alive)
        if not any(m.has_state for m in members):
            holders = ", ".join(m.name for m in old.members if m.has_state)
            raise ErdmaError(f"elastic: epoch {old.epoch} failed and none of its members that hold the shared "
                             f"state ({holders}) is left; {self.name}, which has not received it, cannot go on "
                             f"(the job's state is gone with them). Its error: {error}")
        self._enter(propose(self.store, self.keys, old.epoch + 1, members, old.admitted), old)

    def _enter(self, record: Record, old: Record | None) -> None:
        """Make ``record``'s ProcessGroup (the old one is closed on a thread of its own: peers that are gone
        must not delay the new one)."""
        index = record.index(self.id)
        if index is None:
            raise ExcludedError(f"elastic: epoch {record.epoch} does not include this peer")
        self._drop_pg()
        self.record, self._op = record, 0
        self.counters["epochs"] += 1
        if self.liveness is not None:
            self.liveness.watch(tuple(m.id for m in record.members), self._lapse, self._ahead, fresh=old is None)
        try:
            if old is not None:
                self._admit_tickets(old.admitted, record)
            prefix = PrefixStore(self.store, self.keys("pg", record.epoch) + "/", lambda: self._called_off(record, index))
            started = time.monotonic()
            self._pg = init_with_store(prefix, index, len(record.members), self.conf)
            self._moved, self._slow = 0, self._pg.slow_peers()
            prefix.settle()
            self.setup_s = time.monotonic() - started
            self._was_up = True
        except ErdmaError as exc:
            # a member that died before the epoch was up: the others fail their set-up too, and vote so
            log.warning("elastic: epoch %d set-up failed on %s: %s", record.epoch, self.name, exc)
            # a newcomer (not a founder) whose group never came up: its first epoch may have been called off
            # by a member that failed first, so "first" means never up, not the first epoch it was put in
            if isinstance(exc, UnreachableError) and not self._was_up and record.epoch > 1 \
                    and not record.members[index].has_state:
                self._decide(self._unreachable(record, index, exc), retry=False)  # votes itself out, raises
            outcome = self._decide(exc, not isinstance(exc, (ConfigError, AuthenticationError)))
            if outcome.commit:  # cannot happen: this member voted fail
                raise
            self._recover(outcome, exc)
            return
        self._lapse()  # a lapse seen after the last look and before the group was up ends its first collective
        if self.announce and index == 0:
            self._say(record, old)

    def _agree_paths(self) -> None:
        """A member's paths moved in the step just committed: every member agrees on the slow links again
        and runs later ring allreduces in the order they give. Should that fail here, the epoch's group is
        aborted, and the next step forms a new epoch (whose set-up agrees anew)."""
        assert self._pg is not None
        try:
            if self._pg.agree_paths():
                log.info("elastic: epoch %d: paths moved; ring allreduces now run in the order %s", self.epoch,
                         list(self._pg.ring))
        except ErdmaError as exc:
            log.warning("elastic: epoch %d: agreeing on the moved paths failed (%s); the next step forms a new "
                        "epoch", self.epoch, exc)
            self._pg.abort()

    def _unreachable(self, record: Record, index: int, exc: UnreachableError) -> UnreachableError:
        """What a newcomer that could not connect to members of the epoch that admitted it says as it goes:
        the pairs, by name. It leaves rather than draws another ticket: from where it is, every epoch that
        took it in would fail the same way, and the members would lose a connect timeout each time."""
        pairs = ", ".join(f"{self.name} - {record.members[p].name}" for p in exc.peers if p < len(record.members))
        return UnreachableError(self._cannot(pairs, f"epoch {record.epoch}; the members go on without it")
                                + " Its error: " + str(exc), peers=exc.peers, rank=index, op="connect")

    def _cannot(self, pairs: str, when: str) -> str:
        return (f"elastic: {self.name} cannot take part in job {self.keys.job!r} from where it runs: no connection "
                f"within timeouts.connect for the pairs {pairs} ({when}). A peer behind a NAT that maps each "
                "destination to a new port needs a relay: traversal.stun.relay, with transport.name = \"quic\" or "
                "transport.fallback = \"quic\".")

    def _called_off(self, record: Record, index: int) -> str | None:
        """Why the set-up of ``record``'s group should stop now, or None: a member's beats lapsed (it will
        never connect), or another member's set-up failed and its vote aborted the epoch's first ballot (it
        stopped connecting). Either way this member votes too, and the survivors form the next epoch without
        waiting for ``timeouts.connect``."""
        if self.liveness is not None and self._judges(record):
            lapsed = self.liveness.lapsed()
            names = [m.name for m in record.members if m.id in lapsed]
            if names:
                return f"no sign of life from {', '.join(names)} for {self.liveness.timeout:.1f}s"
        first = Ballot(self.store, self.keys, record.epoch, 0, index, len(record.members))  # the epoch's first step
        return f"another member's set-up of epoch {record.epoch} failed" if first.aborted() else None

    def _transfer(self) -> None:
        """Bring every member of the epoch to the shared state; repeated on the survivors until it commits."""
        while True:
            assert self._pg is not None and self.record is not None
            error: BaseException | None = None
            try:
                self._ready()
                has = self.record.members[self.rank()].has_state
                step = shared.transfer(self._pg, self.state, self.step, has)
            except ErdmaError as exc:
                error = exc
            outcome = self._decide(error)
            if outcome.commit:
                self.counters["admitted"] += sum(not m.has_state for m in self.record.members)
                self.step = step
                self.record = dataclasses.replace(self.record, members=tuple(Member(m.id, m.name, True)
                                                                                 for m in self.record.members))
                # no tickets taken from this commit: the members came here from their step boundary and go on
                # to their step, a newcomer from its join to its first boundary, where tickets drawn since the
                # admitting step would make it open the next epoch alone while the members step
                return
            self._recover(outcome, error)

    def _newcomers(self, first_after: int, upto: int) -> tuple[Member, ...]:
        return newcomers(self.store, self.keys, first_after, upto)

    # ---- newcomers ---------------------------------------------------------------------------------------
    def _join(self) -> None:
        """Draw a ticket, wait to be admitted (or found the job with the first ``min_peers``), receive the
        state."""
        deadline = time.monotonic() + self.join_timeout
        self._probes = None
        given = self.conf.sources.get("elastic.min_peers", "default") != "default"
        self.min_peers = job_min_peers(self.store, self.keys, self.min_peers, given)
        while True:
            if self._clients is not None and self.conf["elastic.admission_check"]:
                self._check_paths(deadline)
            ticket = self.store.add(self.keys("tickets"), 1)
            self.store.set(self.keys("ticket", ticket), f"{self.id} {self.name}".encode())
            if ticket == self.min_peers and getattr(self.store, "founds", True):  # founds the job: the peers
                # that drew tickets so far (on a store with no server its creator does: ``founding``)
                drawn = self.store.add(self.keys("tickets"), 0)
                self._admit_tickets(0, propose(self.store, self.keys, 1, founders(self.store, self.keys, drawn),
                                               drawn))
            epoch = self._wait(ticket, deadline)
            record = Record.decode(self.store.get(self.keys("epoch", epoch), 5.0))
            if record.index(self.id) is None or record.epoch <= self._left:
                # skipped (its name came too late), or an admission from before this peer was counted out (a
                # ticket number drawn again after the store lost the count: the epoch it was a member of,
                # whose set-up it did once): draw again
                continue
            self._probes = record.probes  # the path checks asked for after this record may name this peer
            try:
                self._enter(record, None)
                self._transfer()
                return
            except ExcludedError:
                self._drop_pg()
                self._left = max(self._left, record.epoch)
                self.record = None

    def _check_paths(self, deadline: float) -> None:
        """Before drawing a ticket: the latest epoch's members and this newcomer check the paths between them
        (``admission``). When some pair did not connect, say which, in one line, and check again after a
        wait that doubles (5 s to 60 s); at ``deadline`` (``elastic.join_timeout``) raise UnreachableError
        naming the pairs. The members go on stepping throughout."""
        wait = admission.FIRST_WAIT_S
        assert self._clients is not None
        while True:
            verdict = admission.check(self.store, self._clients, self.conf, self.keys, self.id, self.name, deadline,
                                      lambda: self._finished("its paths were checked"))
            if verdict.unanswered:
                continue
            if not verdict.unreachable:
                if verdict.checked:
                    log.info("elastic: %s connects to the %d members it checked; drawing a ticket", self.name,
                             verdict.checked)
                return
            pairs = ", ".join(f"{self.name} - {m}" for m in verdict.unreachable)
            said = self._cannot(pairs, "checked before it was admitted; the members went on stepping")
            if time.monotonic() + wait > deadline:
                raise UnreachableError(f"{said} It stopped checking at elastic.join_timeout "
                                       f"({self.join_timeout:.0f}s).", rank=None, op="join")
            sys.stderr.write(f"{said} Checking again in {wait:.0f}s.\n")
            sys.stderr.flush()
            time.sleep(wait)
            wait = min(2 * wait, admission.LONGEST_WAIT_S)

    def _finished(self, before: str) -> None:
        """Raise JobFinishedError when the job finished (``finish``) before ``before``."""
        step = finished_step(self.store, self.keys)
        if step is None:
            return
        raise JobFinishedError(f"elastic: job {self.keys.job!r} finished at step {step} before {before}")

    def _wait(self, ticket: int, deadline: float) -> int:
        key = self.keys("admit", ticket)
        while True:
            try:
                return int(self.store.get(key, min(1.0, max(0.01, deadline - time.monotonic()))))
            except CollectiveTimeoutError:
                self._finished(f"ticket {ticket} was admitted")
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"elastic: ticket {ticket} was not admitted within {self.join_timeout:.0f}s (is the job "
                        f"running and reaching step boundaries? it starts once {self.min_peers} peers joined)"
                    ) from None

    def _admit_tickets(self, after: int, record: Record) -> None:
        """Tell the newcomers with tickets ``after+1..record.admitted`` which epoch took them (a ticket the
        record skipped reads it too, finds itself missing and draws again)."""
        for t in range(after + 1, record.admitted + 1):
            self.store.compare_set(self.keys("admit", t), b"", str(record.epoch).encode())

    def _rejoin(self) -> None:
        self.counters["rejoined"] += 1
        if self.record is not None:
            self._left = max(self._left, self.record.epoch)
        self._drop_pg()
        self.record = None
        self._join()

    # ---- helpers -----------------------------------------------------------------------------------------
    def _drop_pg(self) -> None:
        """Close the epoch's group on a thread of its own, waited for up to ``CLOSE_WAIT_S``: peers that are gone
        must not delay the next one much, and a group that closes in time has given back its data socket, which
        the traversal then lends to the next set-up with its mapping and relay allocation (erdma-p2p ``kept``)."""
        if self._pg is not None:
            closing = threading.Thread(target=_destroy, args=(self._pg,), name="erdma-elastic-close", daemon=True)
            closing.start()
            self._pg = None
            closing.join(CLOSE_WAIT_S)
            if closing.is_alive():
                log.info("elastic: epoch %d's group is still closing after %.1f s; the next set-up goes on beside it",
                         self.epoch, CLOSE_WAIT_S)

    def _say(self, record: Record, old: Record | None) -> None:
        before = {m.id for m in old.members} if old else set()
        now = {m.id for m in record.members}
        joined = [m.name for m in record.members if m.id not in before]
        left = [m.name for m in (old.members if old else ()) if m.id not in now]
        sys.stderr.write(f"erdma elastic: epoch {record.epoch}: {len(record.members)} members "
                         f"[{', '.join(self.members())}]" + (f" joined: {', '.join(joined)}" if joined else "")
                         + (f" left: {', '.join(left)}" if left else "") + "\n")
        sys.stderr.flush()


def _destroy(pg: ProcessGroup) -> None:
    started = time.monotonic()
    try:
        pg.destroy()
    except Exception as exc:  # its peers may be gone; nothing depends on this
        log.debug("elastic: closing an old epoch's group: %s", exc)
    log.debug("elastic: an old epoch's group closed in %.2f s", time.monotonic() - started)
