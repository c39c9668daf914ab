"""Write-once registers agreed by a quorum of members, with no store: single-decree Paxos, one instance per key,
sans-IO (messages in and out as data, time and randomness as arguments).

This is what an elastic job without a server decides its membership with: a key belongs to one epoch and its
acceptors are fixed with it (the next epoch's record is decided by the members of the epoch before, so only
a majority of them can make it, and the side of a partition without one cannot). A register's first decided
value is final, which is the one store call membership makes to decide anything: ``compare_set(key, b"",
value)``.

- ``Acceptor``: what one member promised and accepted, per key. It answers only what a member sent (the
  caller authenticates the sender) and keeps at most ``MAX_KEYS`` keys and ``MAX_VALUE`` bytes per value.
  Its state lives in memory: a member that crashes never comes back as the same acceptor (it joins again as
  a newcomer with a new id), so its loss counts as one acceptor fewer, never as one that forgot.
- ``Proposal``: one member's attempt to decide ``key`` (with its own ``value``, or ``None`` to learn what
  was decided). ``start`` sends Prepare to every acceptor; a majority of Promises lets it send Accept, with
  the value accepted at the highest ballot among them if there is one, else its own; a majority of
  Accepted decides. Enough Refused that no majority is left, or no majority within the round's wait, starts
  again with a higher ballot after a random back-off (dueling proposers). The wait is ``retry_s`` in the first
  round and doubles each round up to ``ROUND_MAX`` times it: answers slower than ``retry_s`` (a loaded
  machine, a far member) end a later round, where a fixed wait would start every round anew before its
  answers came. A read that finds nothing accepted in
  a majority of Promises ends ``EMPTY``: nothing is decided yet.
- Retiring keys: an acceptor's state for a key cannot just be dropped (a member that fell behind would then
  decide the key anew, maybe otherwise). The caller gives each acceptor ``retired(key)``, true for the keys of
  steps and epochs the members are done with, and only then ``forget``s them: a retired key is refused with
  ``RETIRED`` in place of a promise, and a proposal refused so ends ``STALE``, deciding nothing.
- ``Chosen``: a proposal that decided tells every acceptor the value (``Node.learned``), so that members
  learn a decision as it is made instead of reading it (a read is a round with a higher ballot, which would
  interrupt a proposal in flight). A learned value is a hint that only saves a read: a member that missed
  the message reads, and finds the same value.
- ``Node``: one member's acceptor, proposals and learned values, messages in and out as bytes, its own
  handled at once.
- ``encode`` / ``decode``: the messages on the wire (``decode`` refuses malformed input with ProtocolError).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import ProtocolError

MAX_KEYS = 4096  # an acceptor's keys at once (the caller forgets those of past epochs: ``Acceptor.forget``)
MAX_VALUE = 1 << 20  # bytes in one value (an epoch record of a few thousand members)
MAX_KEY = 256  # bytes in one key
MAX_ID = 64  # bytes in one proposer id
ROUND_MAX = 8  # a round waits for answers at most this many times ``retry_s``


@dataclass(frozen=True, order=True)
class Ballot:
    round: int
    proposer: str  # ties between proposers of one round broken by id: ballots are unique

    def next(self, proposer: str) -> Ballot:
        return Ballot(self.round + 1, proposer)


NONE = Ballot(0, "")
RETIRED = Ballot(2**64 - 1, "")  # what an acceptor says it promised for a retired key: above every ballot


@dataclass(frozen=True)
class _Keyed:
    key: str
    ballot: Ballot


class Prepare(_Keyed):
    """Phase 1: promise to refuse every ballot below this one, and say what you accepted."""


@dataclass(frozen=True)
class Promise:
    key: str
    ballot: Ballot  # the Prepare's
    accepted: Ballot  # NONE: nothing accepted
    value: bytes | None


@dataclass(frozen=True)
class Accept:
    key: str
    ballot: Ballot
    value: bytes


class Accepted(_Keyed):
    """Phase 2's answer: the acceptor took the Accept of this ballot."""


@dataclass(frozen=True)
class Refused:
    key: str
    ballot: Ballot  # the refused message's
    promised: Ballot  # what the acceptor promised instead


@dataclass(frozen=True)
class Chosen:
    key: str
    ballot: Ballot  # the ballot a majority accepted
    value: bytes


Message = Prepare | Promise | Accept | Accepted | Refused | Chosen


class Acceptor:
    """One member's side of every register it is an acceptor of. ``retired(key)``: whether ``key`` belongs to
    what the members are done with (refused from then on, whatever this acceptor held for it)."""

    def __init__(self, retired: Callable[[str], bool] = lambda key: False) -> None:
        self._promised: dict[str, Ballot] = {}
        self._accepted: dict[str, tuple[Ballot, bytes]] = {}
        self._retired = retired

    def handle(self, msg: Prepare | Accept) -> Promise | Accepted | Refused:
        """The answer to a member's Prepare or Accept (the caller sends it back to that member only)."""
        key = msg.key
        if self._retired(key):
            return Refused(key, msg.ballot, RETIRED)
        promised = self._promised.get(key, NONE)
        if msg.ballot < promised:  # (a Prepare at the promised ballot, sent twice, is answered twice)
            return Refused(key, msg.ballot, promised)
        if key not in self._promised and len(self._promised) >= MAX_KEYS:
            raise ProtocolError(f"paxos: an acceptor holds {MAX_KEYS} keys already; {key!r} refused (are past "
                                "epochs' keys forgotten?)")
        self._promised[key] = msg.ballot
        if isinstance(msg, Prepare):
            ballot, value = self._accepted.get(key, (NONE, None))
            return Promise(key, msg.ballot, ballot, value)
        self._accepted[key] = (msg.ballot, msg.value)
        return Accepted(key, msg.ballot)

    def forget(self, prefix: str, exact: bool = False) -> None:
        """Drop every key starting with ``prefix`` (only ``prefix`` itself with ``exact``): an epoch the members
        are done with; ``retired`` must say so for each of them first, or a member that fell behind could
        decide one of them anew."""
        for table in (self._promised, self._accepted):
            for key in [k for k in table if k == prefix or (not exact and k.startswith(prefix))]:
                del table[key]

    def keys(self) -> int:
        return len(self._promised)


class Empty:
    """An outcome with no value."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


EMPTY = Empty("EMPTY")  # a read's outcome when nothing is decided yet
STALE = Empty("STALE")  # the outcome of a proposal for a retired key: nothing decided, and nothing can be


class Proposal:
    """Deciding (or reading) one key among ``acceptors`` (member ids, this one among them or not)."""

    def __init__(self, key: str, value: bytes | None, me: str, acceptors: Sequence[str], *, retry_s: float,
                 rng: random.Random) -> None:
        if len(set(acceptors)) != len(acceptors) or not acceptors:
            raise ValueError(f"paxos: acceptors must be distinct and at least one: {list(acceptors)!r}")
        if value is not None and len(value) > MAX_VALUE:
            raise ValueError(f"paxos: a value of {len(value)} bytes; at most {MAX_VALUE}")
        self.key, self.value, self.me = key, value, me
        self.acceptors = frozenset(acceptors)
        self.quorum = len(acceptors) // 2 + 1
        self.retry_s, self._rng = retry_s, rng
        self.ballot = NONE
        self.outcome: bytes | Empty | None = None  # None: not yet
        self.rounds = 0
        self._phase = 0  # 1: preparing, 2: accepting, 0: backing off
        self._promises: dict[str, Promise] = {}
        self._accepted: set[str] = set()
        self._refused: set[str] = set()
        self._proposed: bytes = b""
        self._highest = NONE  # the highest ballot any acceptor told of
        self.deadline = 0.0  # when ``poll`` has something to do

    @property
    def heard(self) -> set[str]:
        """The acceptors that answered this round (promised, accepted or refused)."""
        return set(self._promises) | self._accepted | self._refused

    def start(self, now: float) -> list[tuple[str, Message]]:
        """Prepare with a ballot above every one seen so far."""
        self.ballot = max(self.ballot, self._highest).next(self.me)
        self.rounds += 1
        self._phase, self._promises, self._accepted, self._refused = 1, {}, set(), set()
        self.deadline = now + self.round_s
        return [(a, Prepare(self.key, self.ballot)) for a in sorted(self.acceptors)]

    @property
    def round_s(self) -> float:
        """How long this round waits for a majority's answers."""
        return self.retry_s * min(ROUND_MAX, 2 ** max(0, self.rounds - 1))

    def poll(self, now: float) -> list[tuple[str, Message]]:
        """At ``deadline``: a round that got no majority backs off; a back-off over starts the next round."""
        if self.outcome is not None or now < self.deadline:
            return []
        if self._phase:
            self._back_off(now)
            return []
        return self.start(now)

    def receive(self, sender: str, msg: Message, now: float) -> list[tuple[str, Message]]:
        """An acceptor's answer (``sender``: the member it came from, as the connection proved). Answers
        from non-acceptors, to other keys or ballots, or after the outcome are ignored."""
        if (self.outcome is not None or sender not in self.acceptors or msg.key != self.key
                or isinstance(msg, Prepare | Accept | Chosen) or msg.ballot != self.ballot):
            return []
        if isinstance(msg, Refused):
            if msg.promised == RETIRED:
                self.outcome = STALE
                return []
            self._highest = max(self._highest, msg.promised)
            self._refused.add(sender)
            if self._phase and len(self._refused) > len(self.acceptors) - self.quorum:
                self._back_off(now)  # no majority can answer this ballot any more
            return []
        if isinstance(msg, Promise) and self._phase == 1:
            self._highest = max(self._highest, msg.accepted)
            self._promises[sender] = msg
            if len(self._promises) < self.quorum:
                return []
            return self._phase_two(now)
        if isinstance(msg, Accepted) and self._phase == 2:
            self._accepted.add(sender)
            if len(self._accepted) >= self.quorum:
                self.outcome = self._proposed
                return [(a, Chosen(self.key, self.ballot, self._proposed)) for a in sorted(self.acceptors)]
        return []

    def _phase_two(self, now: float) -> list[tuple[str, Message]]:
        best = max(self._promises.values(), key=lambda p: p.accepted)
        if best.value is None:
            if self.value is None:
                self.outcome = EMPTY  # nothing accepted in a majority: nothing was decided before this ballot
                return []
            self._proposed = self.value
        else:
            self._proposed = best.value
            if sum(p.accepted == best.accepted for p in self._promises.values()) >= self.quorum:
                self.outcome = best.value  # a majority accepted it: decided already
                return []
        self._phase = 2
        self.deadline = now + self.round_s
        return [(a, Accept(self.key, self.ballot, self._proposed)) for a in sorted(self.acceptors)]

    def _back_off(self, now: float) -> None:
        self._phase = 0
        self.deadline = now + self._rng.uniform(0.0, self.round_s)


class Node:
    """One member's registers: its acceptor and its proposals, with messages in and out as bytes (what an I/O
    adapter moves over the members' authenticated connections). ``sender`` is always who the connection
    proved the bytes came from. One proposal per key at a time; its outcome stays until ``forget``."""

    def __init__(self, me: str, *, retry_s: float, rng: random.Random,
                 retired: Callable[[str], bool] = lambda key: False) -> None:
        self.me, self.retry_s, self._rng = me, retry_s, rng
        self.acceptor = Acceptor(retired)
        self._proposals: dict[str, Proposal] = {}
        self._learned: dict[str, bytes] = {}

    def propose(self, key: str, value: bytes | None, acceptors: Sequence[str], now: float) -> list[tuple[str, bytes]]:
        """Decide ``key`` among ``acceptors`` with ``value`` (None: learn what was decided); the messages to
        send. A key already being decided here goes on as it was."""
        if key in self._proposals:
            return []
        p = self._proposals[key] = Proposal(key, value, self.me, acceptors, retry_s=self.retry_s, rng=self._rng)
        return self._route(p.start(now), now)

    def outcome(self, key: str) -> bytes | Empty | None:
        p = self._proposals.get(key)
        return None if p is None else p.outcome

    def proposal(self, key: str) -> Proposal | None:
        return self._proposals.get(key)

    def learned(self, key: str) -> bytes | None:
        """The value decided for ``key`` as this member learned it (its own proposal's outcome, or a Chosen
        from another's), without a round; None when not learned (decided or not)."""
        p = self._proposals.get(key)
        if p is not None and isinstance(p.outcome, bytes):
            return p.outcome
        return self._learned.get(key)

    def receive(self, sender: str, data: bytes, now: float) -> list[tuple[str, bytes]]:
        """Bytes from member ``sender``: a request to this acceptor (answered) or an answer to one of this
        member's proposals. ProtocolError for bytes that are no message (the caller drops that connection);
        an acceptor that is full answers nothing."""
        msg = decode(data)
        if isinstance(msg, Chosen):
            self._learn(msg)
            return []
        if isinstance(msg, Prepare | Accept):
            try:
                return [(sender, encode(self.acceptor.handle(msg)))]
            except ProtocolError:
                return []  # full (past epochs not forgotten): no promise; the proposer retries elsewhere
        p = self._proposals.get(msg.key)
        return [] if p is None else self._route(p.receive(sender, msg, now), now)

    def poll(self, now: float) -> list[tuple[str, bytes]]:
        """What the proposals' timers send at ``now``."""
        out: list[tuple[str, bytes]] = []
        for p in list(self._proposals.values()):
            if p.outcome is None and now >= p.deadline:
                out += self._route(p.poll(now), now)
        return out

    def deadline(self) -> float | None:
        """When ``poll`` next has something to do (None: nothing pending)."""
        return min((p.deadline for p in self._proposals.values() if p.outcome is None), default=None)

    def forget_proposal(self, key: str) -> None:
        """Drop this member's proposal for ``key`` (a read done with: the next read is a new round)."""
        self._proposals.pop(key, None)

    def forget(self, prefix: str, exact: bool = False) -> None:
        """Drop every key starting with ``prefix`` (only ``prefix`` with ``exact``): acceptor state, proposals
        and learned values (an epoch done with)."""
        self.acceptor.forget(prefix, exact)
        for table in (self._proposals, self._learned):
            for key in [k for k in table if k == prefix or (not exact and k.startswith(prefix))]:
                del table[key]

    def _learn(self, msg: Chosen) -> None:
        if msg.key in self._learned or len(self._learned) < MAX_KEYS:  # (bounded like the acceptor's keys)
            self._learned[msg.key] = msg.value

    def _route(self, out: list[tuple[str, Message]], now: float) -> list[tuple[str, bytes]]:
        """Messages to this member itself are handled here at once; the rest are encoded for the wire."""
        wire: list[tuple[str, bytes]] = []
        queue = list(out)
        while queue:
            to, msg = queue.pop(0)
            if to != self.me:
                wire.append((to, encode(msg)))
            elif isinstance(msg, Chosen):
                self._learn(msg)
            elif isinstance(msg, Prepare | Accept):
                try:
                    queue.append((self.me, self.acceptor.handle(msg)))
                except ProtocolError:
                    pass
            elif (p := self._proposals.get(msg.key)) is not None:
                queue += p.receive(self.me, msg, now)
        return wire


# ---- the wire ------------------------------------------------------------------------------------------------
# one message: kind (u8), key (u16 length + UTF-8), ballot (u64 round, u8 length + proposer id), then by kind:
# Promise: accepted ballot, has-value (u8), value (u32 length + bytes); Accept and Chosen: value; Refused:
# promised ballot
_KINDS: dict[type, int] = {Prepare: 1, Promise: 2, Accept: 3, Accepted: 4, Refused: 5, Chosen: 6}


def _ballot(b: Ballot) -> bytes:
    pid = b.proposer.encode()
    return struct.pack("!QB", b.round, len(pid)) + pid


def _value(v: bytes) -> bytes:
    return struct.pack("!I", len(v)) + v


def encode(msg: Message) -> bytes:
    key = msg.key.encode()
    out = struct.pack("!BH", _KINDS[type(msg)], len(key)) + key + _ballot(msg.ballot)
    if isinstance(msg, Promise):
        out += _ballot(msg.accepted) + (b"\0" if msg.value is None else b"\1" + _value(msg.value))
    elif isinstance(msg, Accept | Chosen):
        out += _value(msg.value)
    elif isinstance(msg, Refused):
        out += _ballot(msg.promised)
    return out


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise ProtocolError(f"paxos: a message of {len(self.data)} bytes ends early (wanted {n} at {self.at})")
        self.at += n
        return self.data[self.at - n:self.at]

    def unpack(self, fmt: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def text(self, n: int, most: int, what: str) -> str:
        if n > most:
            raise ProtocolError(f"paxos: a {what} of {n} bytes; at most {most}")
        try:
            return self.take(n).decode()
        except UnicodeDecodeError:
            raise ProtocolError(f"paxos: a {what} that is not UTF-8") from None

    def ballot(self) -> Ballot:
        rnd, n = self.unpack("!QB")
        return Ballot(rnd, self.text(n, MAX_ID, "proposer id"))

    def value(self) -> bytes:
        (n,) = self.unpack("!I")
        if n > MAX_VALUE:
            raise ProtocolError(f"paxos: a value of {n} bytes; at most {MAX_VALUE}")
        return self.take(n)


def decode(data: bytes) -> Message:
    r = _Reader(data)
    kind, n = r.unpack("!BH")
    key = r.text(n, MAX_KEY, "key")
    ballot = r.ballot()
    msg: Message
    if kind == 1:
        msg = Prepare(key, ballot)
    elif kind == 2:
        accepted = r.ballot()
        (has,) = r.unpack("!B")
        if has > 1:
            raise ProtocolError(f"paxos: a Promise's value flag is {has}; valid: 0 or 1")
        msg = Promise(key, ballot, accepted, r.value() if has else None)
    elif kind == 3:
        msg = Accept(key, ballot, r.value())
    elif kind == 4:
        msg = Accepted(key, ballot)
    elif kind == 5:
        msg = Refused(key, ballot, r.ballot())
    elif kind == 6:
        msg = Chosen(key, ballot, r.value())
    else:
        raise ProtocolError(f"paxos: message kind {kind}; valid: 1-6")
    if r.at != len(data):
        raise ProtocolError(f"paxos: {len(data) - r.at} bytes after a message")
    return msg
