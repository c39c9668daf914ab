"""An elastic job's store with no server: what membership decides is decided by the members themselves, over
their mesh; everything else goes on a bulletin (the DHT) that nobody needs to trust.

``PeerStore`` is the ``CasStore`` an ``ElasticGroup`` uses for ``dht://``. It routes each key by what it is:

- An epoch's record (``epoch/<e>``, e > 1) and a step's votes and outcome (``vote/<e>/<s>/...``) are write-once
  registers (``registers``) whose acceptors are one epoch's members (``quorums``): the record by the members of
  the epoch before, the votes by the epoch's own. A record, once decided, is also put on the bulletin, where
  newcomers and members that fell behind read it; nobody can put another there (the bulletin's records are
  signed with the job's secret, and the key is write-once), so a DHT node can withhold a record but never
  change one. A decision that no majority answers is tried again, saying once every ``PAUSE_SAY_S`` that this
  member is paused: the side of a partition without a majority of the epoch waits, it never goes on alone.
  A vote's counter (``vote/.../count``) is the number of ``done`` votes this member has learned.
- The first epoch's record is written on the bulletin by the job's creator (``founding.found``), not by a peer
  (``founds = False``): there is no epoch before it to decide it.
- The keys of an epoch's ProcessGroup set-up (``pg/<e>/...``) are kept among the epoch's members over their
  mesh (``board``): on a DHT each look is a lookup, and a counter's share lost to a racing write comes back
  only when its writer adds again.
- A newcomer's path checks (``admission``: ``probe/<n>/...``, each request's pairs' set-ups) are kept the same
  way, on a board per request among the newcomer and the members it asked, which the request's record
  (``probe/<n>``, on the bulletin) names.
- Everything else (newcomers' tickets and names, the admissions the records imply, the path checks' requests,
  ``finished``, and ``epoch/latest``: the latest epoch's number, which its member 0 writes and writes again
  while it runs, since the DHT loses old records and the epochs it holds have gaps) is on the bulletin; a
  newcomer waiting for its admission adds 0 to the ticket count each time it looks, so that its share, if a
  racing draw dropped it, comes back.
  ``compare_set`` there is "the value there, else this one": a race can only make a newcomer draw again (its
  ticket is not in the record it reads), since what is admitted is decided in the records.

Keys of the steps and epochs every member is done with are retired (``paxos.RETIRED``) and forgotten: a member
whose vote in step ``s`` of epoch ``e`` is decided knows that every member finished step ``s - 2`` of ``e``
and, from ``s = 1``, every epoch before ``e``. A proposal for a retired key raises ExcludedError (this member
fell behind and joins again).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Any

from ..errors import CollectiveTimeoutError, ErdmaError
from . import quorums
from .board import Boards
from .liveness import MeshSigns
from .membership import DONE, ExcludedError, JobFinishedError, Keys, Record, finished_step
from .mesh import Mesh
from .registers import Registers, RetiredError

log = logging.getLogger("erdma.elastic")
DECIDE_S = 5.0  # one try at a decision before this member says it is paused and tries again
PAUSE_SAY_S = 10.0
READ_S = 1.0  # a register not learned is read (a round) at most this often while a member waits for it
SIGNS = 1  # the mesh channel of the members' signs of life (0: the registers')
BOARDS = 2  # the mesh channel of the epochs' set-up keys (``board``)
PROBES = 3  # the mesh channel of the newcomers' path checks (a board per request)
KEEP_PROBES = 16  # path checks' boards kept before the latest request known here
SIGNS_EPOCHS = 3
KEEP_EPOCHS = 8  # records kept here before the current epoch (their members' links with them)


class PeerStore:
    founds = False  # the first epoch is the creator's (``founding``)
    scan_s = 0.1  # how often a waiting ballot looks at every vote: the votes it has learned, read here
    commits_first = True  # each member counts the votes it learned: all see every vote done at once, so the
    # commit is member 0's (the others' after ``membership.PREFER_S``), not a duel of every member's

    def __init__(self, bulletin: Any, secret: bytes, job: str, *, host: str, advertise: str,
                 towards: str | None = None) -> None:
        """``host``: where the mesh listens; ``advertise``: the address members dial it at; ``towards``: a host
        of the DHT (a transport set up on this store advertises the address that routes to it, as to a store's
        host)."""
        self.member_id = secrets.token_hex(8)
        if towards is not None:
            self.host = towards
        self.keys = Keys(job)
        self._bulletin = bulletin
        self._records: dict[int, Record] = {}
        self._where_cache: dict[str, tuple[str, int]] = {}
        self._read_at: dict[str, float] = {}
        self._at = (0, -1)  # the latest (epoch, step) in which this member's own vote is decided
        self._held: set[tuple[int, int]] = set()  # (epoch, step) of the vote keys this member has touched
        self._held_records: set[int] = set()  # epochs whose record keys it has touched
        self._lock = threading.Lock()
        self._said = 0.0
        self.mesh = Mesh(secret, job, self.member_id, self._where, host=host)
        self._regs = Registers(self.member_id, self.mesh.channel(0), retired=self._retired)
        self._boards = Boards(self.member_id, self.mesh.channel(BOARDS), self._epoch_members)
        self._requests: dict[int, tuple[str, ...]] = {}  # path check n: the newcomer and the members it asked
        self._newest = 0  # the newest epoch whose record this member learned
        self._hinting = False  # it writes ``epoch/latest`` (it is that record's member 0) and keeps it written
        self._probes = Boards(self.member_id, self.mesh.channel(PROBES), self._requests.get, what="path check")
        try:
            bulletin.set(self.keys("mesh", self.member_id), f"{advertise} {self.mesh.address[1]}".encode())
            keep = getattr(bulletin, "keep", None)
            if keep is not None:  # a DHT forgets what nodes that left held: this member's address is written
                keep(self.keys("mesh", self.member_id))  # again while it runs, for newcomers to reach it by
        except BaseException:  # (the caller closes the bulletin)
            self.close(bulletin=False)
            raise

    # ---- CasStore ------------------------------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        if self._decided_kind(key):
            raise ErdmaError(f"elastic: {key!r} is decided by the members, never set")
        if (on := self._on_board(key)) is not None:
            on[0].set(*on[1:], value)
            return
        self._bulletin.set(key, value)
        self._request(key, value)

    def get(self, key: str, timeout: float) -> bytes:
        if (on := self._on_board(key)) is not None:
            return on[0].get(*on[1:], timeout)
        kind = self._decided_kind(key)
        if kind is None:
            rest = self._rest(key) or ""
            if rest.startswith("admit/"):  # a newcomer waiting: its share of the ticket count, which a racing
                self._bulletin.add(self.keys("tickets"), 0)  # draw may have dropped, comes back (``DhtStore.add``)
            value = bytes(self._bulletin.get(key, timeout))
            self._request(key, value)
            if key == self.keys("epoch", quorums.FIRST):  # the creator's: known here from now on
                with self._lock:
                    self._records.setdefault(quorums.FIRST, Record.decode(value))
            return value
        deadline = time.monotonic() + timeout
        while True:
            got = self._known(key, kind, min(READ_S, max(0.0, deadline - time.monotonic())), read=timeout > 0)
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(f"elastic: {key!r} not decided within {timeout:.1f}s", op="membership")

    def add(self, key: str, amount: int) -> int:
        if (on := self._on_board(key)) is not None:
            return on[0].add(*on[1:], amount)
        rest = self._rest(key)
        if rest is not None and rest.startswith("vote/") and rest.endswith("/count"):
            epoch = int(rest.split("/")[1])
            record = self._records.get(epoch)
            size = len(record.members) if record else 0
            prefix = key[:-len("count")]
            return sum(self._regs.learned(f"{prefix}{m}") == DONE for m in range(size))
        return int(self._bulletin.add(key, amount))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        kind = self._decided_kind(key)
        if kind is None:
            try:
                return bytes(self._bulletin.get(key, 0.0))
            except CollectiveTimeoutError:
                self._bulletin.set(key, desired)
                return desired
        if expected != b"":
            raise ErdmaError(f"elastic: {key!r} is write-once: compare_set only from empty (given {expected!r})")
        value = self._decide(key, desired)
        self._learned(key, kind, value)
        return value

    def close(self, bulletin: bool = True) -> None:
        """Leave: the registers, the boards and the mesh stop; the bulletin's records stay for the others
        (``detach``, where the bulletin has it: a DHT client's ``close`` would delete the keys it wrote, the
        job's records among them)."""
        self._regs.close()
        self._boards.close()
        self._probes.close()
        self.mesh.close()
        if bulletin:
            getattr(self._bulletin, "detach", self._bulletin.close)()

    # ---- for the group -------------------------------------------------------------------------------------
    def signs(self) -> MeshSigns:
        """The members' signs of life over the mesh (``Liveness``'s store), sent to the members of the latest
        ``SIGNS_EPOCHS`` epochs known here: a member counted out, which still watches the epoch it was in until
        it finds out, goes on hearing the others meanwhile, as it would through a store."""
        return MeshSigns(self.mesh.channel(SIGNS), self._members)

    def _members(self) -> tuple[str, ...]:
        with self._lock:
            recent = sorted(self._records)[-SIGNS_EPOCHS:]
            return tuple(dict.fromkeys(m.id for e in recent for m in self._records[e].members))

    # ---- routing -------------------------------------------------------------------------------------------
    def _rest(self, key: str) -> str | None:
        return key[len(self.keys.base):] if key.startswith(self.keys.base) else None

    def _on_board(self, key: str) -> tuple[Boards, int, str] | None:
        """(boards, number, key) for a key kept over the mesh, not on the bulletin: an epoch's ProcessGroup
        set-up (``pg/<e>/...``, among the epoch's members) or a path check's (``probe/<n>/...``, among the
        newcomer and the members it asked; ``probe/<n>`` itself, which names them, is on the bulletin)."""
        rest = self._rest(key)
        if rest is None:
            return None
        parts = rest.split("/", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        boards = self._boards if parts[0] == "pg" else self._probes if parts[0] == "probe" else None
        return None if boards is None else (boards, int(parts[1]), key)

    def _request(self, key: str, value: bytes) -> None:
        """A path check's request (``probe/<n>``, set here by its newcomer or read by a member it asks): who
        takes part in request ``n``'s board. Older boards than ``KEEP_PROBES`` before it are forgotten."""
        parts = (self._rest(key) or "").split("/")
        if len(parts) != 2 or parts[0] != "probe" or not parts[1].isdigit():
            return
        try:
            asked = json.loads(value)
            who = tuple(str(m) for m in (*asked["members"], asked["id"]))
        except (ValueError, KeyError, TypeError):
            return
        n = int(parts[1])
        with self._lock:
            self._requests[n] = who
            for old in [k for k in self._requests if k < n - KEEP_PROBES]:
                del self._requests[old]
        self._probes.forget(n - KEEP_PROBES)

    def _epoch_members(self, epoch: int) -> tuple[str, ...] | None:
        with self._lock:
            record = self._records.get(epoch)
        return None if record is None else tuple(m.id for m in record.members)

    def _decided_kind(self, key: str) -> str | None:
        """"epoch" or "vote" for the keys the members decide (the first epoch's record is the creator's)."""
        rest = self._rest(key)
        if rest is None:
            return None
        parts = rest.split("/")
        if parts[0] == "epoch" and len(parts) == 2 and parts[1].isdigit() and int(parts[1]) > quorums.FIRST:
            return "epoch"
        if parts[0] == "vote" and len(parts) == 4 and parts[3] != "count":
            return "vote"
        return None

    def _record(self, epoch: int) -> Record | None:
        """Epoch ``epoch``'s record: known here, else from the bulletin (where only decided records are put)."""
        record = self._records.get(epoch)
        if record is None:
            try:
                record = Record.decode(self._bulletin.get(self.keys("epoch", epoch), 0.0))
            except CollectiveTimeoutError:
                return None
            with self._lock:
                self._records[epoch] = record
        return record

    def _acceptors(self, key: str) -> tuple[str, ...] | None:
        rest = self._rest(key)
        return None if rest is None else quorums.acceptors(rest, self._record)

    def _where(self, member: str) -> tuple[str, int] | None:
        if member not in self._where_cache:
            try:
                host, port = self._bulletin.get(self.keys("mesh", member), 0.0).decode().split()
            except (CollectiveTimeoutError, ValueError):
                return None
            self._where_cache[member] = (host, int(port))
        return self._where_cache[member]

    # ---- deciding ------------------------------------------------------------------------------------------
    def _decide(self, key: str, value: bytes) -> bytes:
        started = time.monotonic()
        while True:
            acceptors = self._acceptors(key)
            try:
                if acceptors is None:
                    raise CollectiveTimeoutError(f"elastic: the record that says who decides {key!r} is not known "
                                                 "here yet", op="membership")
                return self._regs.decide(key, value, acceptors, DECIDE_S)
            except RetiredError as exc:
                raise ExcludedError(str(exc)) from None
            except CollectiveTimeoutError as exc:
                implied = self._implied(key)
                if implied is not None:
                    return implied
                if finished_step(self, self.keys) is not None:
                    raise JobFinishedError(f"elastic: job {self.keys.job!r} finished while {self.member_id} waited "
                                           f"for {key!r} ({exc})") from None
                self._paused(key, exc, started)

    def _implied(self, key: str) -> bytes | None:
        """A member's vote that the step's outcome, learned, implies: a commit is written only once every vote
        is done (a member whose own proposal did not hear the answers, the others gone since, learns it so)."""
        rest = self._rest(key) or ""
        parts = rest.split("/")
        if parts[0] != "vote" or not parts[-1].isdigit():
            return None
        outcome = self._regs.learned(key.rsplit("/", 1)[0] + "/outcome")
        return DONE if outcome is not None and outcome.startswith(b"commit:") else None

    def _paused(self, key: str, exc: Exception, since: float) -> None:
        now = time.monotonic()
        if now - self._said >= PAUSE_SAY_S:
            self._said = now
            log.warning("elastic: %s paused for %.0fs on %s: %s (connected now to: %s)", self.member_id,
                        now - since, key, exc, ", ".join(sorted(self.mesh.connected())) or "none")

    def _known(self, key: str, kind: str, wait: float, read: bool = True) -> bytes | None:
        """The value decided for ``key`` if this member knows it or can find it within about ``wait`` seconds:
        learned, on the bulletin (a record), or, if ``read``, read (a round, at most every ``READ_S``, the first
        ``READ_S`` after this member began to wait for it: a decision's Chosen tells it sooner). A look
        (``get`` with no time to wait) does not read: a read is a round with a higher ballot, waited for up to
        ``DECIDE_S``, and members that look at the same key at once (each one's set-up asks whether the epoch's
        first step aborted) would duel with each other and with the proposal they look for."""
        if kind == "epoch":
            epoch = int(key.rsplit("/", 1)[1])
            record = self._record(epoch)
            if record is not None:
                return record.encode()
        value = self._regs.wait_learned(key, wait)
        if value is not None:
            return value
        now = time.monotonic()
        acceptors = self._acceptors(key)
        # the first read only READ_S after this member began to wait: a decision comes with its Chosen first
        if not read or acceptors is None or now - self._read_at.setdefault(key, now) < READ_S:
            return None
        self._read_at[key] = now
        try:
            value = self._regs.read(key, acceptors, DECIDE_S)
        except RetiredError as exc:
            raise ExcludedError(str(exc)) from None
        except CollectiveTimeoutError as exc:
            self._paused(key, exc, now)
            return None
        if value is not None:
            self._learned(key, kind, value)
        return value

    def _learned(self, key: str, kind: str, value: bytes) -> None:
        rest = self._rest(key)
        assert rest is not None
        parts = rest.split("/")
        if kind == "epoch":
            record = Record.decode(value)
            with self._lock:
                self._records[record.epoch] = record
                self._held_records.add(record.epoch)
                newest = record.epoch > self._newest
                self._newest = max(self._newest, record.epoch)
                hint = newest and record.index(self.member_id) == 0
                handed_on = newest and not hint and self._hinting  # another member is member 0 now
                self._hinting = hint or (self._hinting and not handed_on)
            self._bulletin.set(key, value)  # for newcomers and members that fell behind
            if hint:  # the latest epoch, for newcomers (``admission.latest``): the DHT loses old records, so
                self._bulletin.set(self.keys("epoch", "latest"), str(record.epoch).encode())  # the ones it holds
                keep = getattr(self._bulletin, "keep", None)  # have gaps; written again while this member runs
                if keep is not None:
                    keep(self.keys("epoch", "latest"))
            elif handed_on:  # its hint is stale from now on: written again, it could outlast the new member 0's
                unkeep = getattr(self._bulletin, "unkeep", None)
                if unkeep is not None:
                    unkeep(self.keys("epoch", "latest"))
            return
        epoch, step = int(parts[1]), int(parts[2])
        with self._lock:
            self._held.add((epoch, step))
        if parts[3].isdigit() and self._records.get(epoch) is not None \
                and self._records[epoch].index(self.member_id) == int(parts[3]):
            self._advance(epoch, step)

    def _advance(self, epoch: int, step: int) -> None:
        """This member's own vote in ``step`` of ``epoch`` is decided: retire and forget what every member
        is done with (the steps and epoch records this member has held keys of)."""
        with self._lock:
            self._at = max(self._at, (epoch, step))
            e, s = self._at
            done = {(pe, ps) for pe, ps in self._held if (pe < e and s >= 1) or (pe == e and ps <= s - 2)}
            self._held -= done
            records = [r for r in self._held_records if r < e and s >= 1]
            self._held_records -= set(records)
        for pe, ps in done:
            self._regs.forget(self.keys("vote", pe, ps) + "/")
        for r in records:
            self._regs.forget(self.keys("epoch", r), exact=True)
        if done or records:
            self._give_back(e)

    def _give_back(self, epoch: int) -> None:
        """What this member holds for members and keys it is done with goes: the records of epochs before the
        last ``KEEP_EPOCHS`` (up to ``epoch``), the links to members none of the kept records names, nor a
        kept path check (their threads and connections: a newcomer's, dropped while it checks its paths, could
        not be dialled back from behind its NAT), and the times of reads of forgotten keys."""
        with self._lock:
            for e in [e for e in self._records if e < epoch - KEEP_EPOCHS]:
                del self._records[e]
            named = {m.id for r in self._records.values() for m in r.members}
            named.update(m for who in self._requests.values() for m in who)  # newcomers checking their paths
            gone = [m for m in self._where_cache if m not in named]
            for m in gone:
                del self._where_cache[m]
            held = {self.keys("vote", pe, ps) + "/" for pe, ps in self._held}
            for key in [k for k in self._read_at if k.rsplit("/", 1)[0] + "/" not in held]:
                del self._read_at[key]
        for m in gone:
            self.mesh.forget(m)
        self._boards.forget(epoch - 1)  # (the epoch's set-up keys stay: its group agrees on paths on them)

    def _retired(self, key: str) -> bool:
        rest = self._rest(key)
        if rest is None:
            return False
        parts = rest.split("/")
        e, s = self._at
        try:
            if parts[0] == "vote" and len(parts) == 4:
                epoch, step = int(parts[1]), int(parts[2])
                return (epoch < e and s >= 1) or (epoch == e and step <= s - 2)
            if parts[0] == "epoch" and len(parts) == 2:
                return int(parts[1]) < e and s >= 1
        except ValueError:
            return False
        return False
