"""A member's write-once registers (``paxos.Node``) on a thread of its own, over a mailbox: it answers other
members' proposals as their messages come, whatever its caller does, and decides keys for its caller with a
timeout. The mailbox carries bytes between members and says who sent them (the connection proved it);
what it loses, duplicates or reorders, the protocol survives.

A decision that cannot be made (no majority of the key's acceptors answers: this member is on the smaller
side of a partition, or most of them are gone) raises CollectiveTimeoutError at its timeout, naming the key,
the acceptors and the ones heard from: the caller pauses and says so, it never goes on alone.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ..errors import CollectiveTimeoutError, ErdmaError, ProtocolError
from . import paxos

log = logging.getLogger("erdma.elastic")
IDLE_S = 0.05  # how long the thread waits for a message when no timer is due sooner


class RetiredError(ErdmaError):
    """The key belongs to a step or epoch the members are done with (``paxos.RETIRED``): this member fell behind
    and learns where the job is from its latest records, not from this key."""


class Mailbox(Protocol):
    def send(self, to: str, data: bytes) -> None:
        """Best effort, never blocks for long; a member that cannot be reached now loses the message."""

    def recv(self, timeout: float) -> tuple[str, bytes] | None:
        """The next message and the member it came from, or None after ``timeout`` seconds."""

    def close(self) -> None: ...


class Registers:
    def __init__(self, me: str, mailbox: Mailbox, *, retry_s: float = 0.2, rng: random.Random | None = None,
                 retired: Callable[[str], bool] = lambda key: False) -> None:
        """``retired``: as ``paxos.Acceptor``'s (keys refused from now on; only those may be ``forget``-ed)."""
        self.me, self._mailbox = me, mailbox
        self._node = paxos.Node(me, retry_s=retry_s, rng=rng or random.Random(), retired=retired)
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"erdma-registers-{me}", daemon=True)
        self._thread.start()

    def decide(self, key: str, value: bytes, acceptors: Sequence[str], timeout: float) -> bytes:
        """The value decided for ``key``: ``value`` if this proposal wins, else the one decided before it
        (without a round when this member learned it already)."""
        known = self.learned(key)
        if known is not None:
            return known
        out = self._settle(key, value, acceptors, timeout)
        assert isinstance(out, bytes)  # a proposal with a value never ends EMPTY
        return out

    def read(self, key: str, acceptors: Sequence[str], timeout: float) -> bytes | None:
        """The value decided for ``key``, or None when a majority says nothing is decided yet."""
        out = self._settle(key, None, acceptors, timeout)
        return out if isinstance(out, bytes) else None

    def learned(self, key: str) -> bytes | None:
        """The value decided for ``key`` if this member has learned it (``paxos.Chosen``), with no message sent;
        None otherwise (``read`` to find out)."""
        with self._cond:
            return self._node.learned(key)

    def wait_learned(self, key: str, timeout: float) -> bytes | None:
        """``learned(key)``, waiting up to ``timeout`` seconds for a Chosen to bring it (no message sent)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (value := self._node.learned(key)) is None and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, IDLE_S))
            return value

    def forget(self, prefix: str, exact: bool = False) -> None:
        with self._cond:
            self._node.forget(prefix, exact)

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self._thread.join(5 * IDLE_S + 1.0)
        self._mailbox.close()

    def _settle(self, key: str, value: bytes | None, acceptors: Sequence[str], timeout: float
                ) -> bytes | paxos.Empty:
        deadline = time.monotonic() + timeout
        with self._cond:
            p = self._node.proposal(key)
            if p is not None and p.value is None:  # a read is a new round each time, and a decision takes
                self._node.forget_proposal(key)  # the place of a read (which would end EMPTY for it)
            out = self._node.propose(key, value, acceptors, time.monotonic())
        self._send(out)
        with self._cond:
            while (outcome := self._node.outcome(key)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    p = self._node.proposal(key)
                    heard = sorted(p.heard) if p is not None else []
                    quorum = len(acceptors) // 2 + 1
                    raise CollectiveTimeoutError(
                        f"elastic: {key!r} was not decided within {timeout:.1f}s: {quorum} of its {len(acceptors)} "
                        f"acceptors ({', '.join(acceptors)}) must answer and {len(heard)} did "
                        f"({', '.join(heard) or 'none'}); this member is cut off from a majority of them",
                        op="membership")
                self._cond.wait(min(left, IDLE_S))
        if outcome is paxos.STALE:
            self._node.forget_proposal(key)
            raise RetiredError(f"elastic: {key!r} belongs to a step or epoch the members are done with: this "
                               "member fell behind them")
        return outcome

    def _send(self, out: list[tuple[str, bytes]]) -> None:
        for to, data in out:
            self._mailbox.send(to, data)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                due = self._node.deadline()
            wait = IDLE_S if due is None else max(0.0, min(IDLE_S, due - time.monotonic()))
            got = self._mailbox.recv(wait)
            with self._cond:
                now = time.monotonic()
                out: list[tuple[str, bytes]] = []
                if got is not None:
                    try:
                        out += self._node.receive(got[0], got[1], now)
                    except ProtocolError as exc:
                        log.warning("elastic: a membership message from %s dropped: %s", got[0], exc)
                out += self._node.poll(now)
                self._cond.notify_all()
            self._send(out)
