"""The set-up keys of an epoch's ProcessGroup, kept by the epoch's members among themselves over their mesh
(a channel of its own) instead of on the DHT, where every look is a lookup and a counter's racing shares
come back only when their writer adds again (rank 0's wait for every rank's set-up share ran out its 5 s).

Each member keeps a board per epoch: the values set, and each counter's shares (one per member, which only
grows: the counter is their sum, so any order of arrival gives the same count). ``set`` and ``add`` send the
value or this member's new share to the epoch's members; ``get`` waits for the value and, every ``ASK_S``
while it waits, asks them for it (a member holding it answers), as does an ``add`` that only reads the count
(its missing shares come back). A message lost with a broken connection is so asked again; nothing waits for
a member that is gone but the caller's own timeout.

The mesh proved who sent each message (a member of the job: the same trust as the job's signed DHT records).
Bounded: ``MAX_ENTRIES`` keys per board (more are dropped), values of at most ``MAX_VALUE`` bytes, and boards
only for epochs from the oldest kept (``forget``) to ``AHEAD`` past the newest known here.

A newcomer's path checks (``admission``) are kept the same way, on boards of their own numbered by request,
among the newcomer and the members it asked (``peer_store``).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence

from ..errors import CollectiveTimeoutError, ProtocolError
from .registers import Mailbox

log = logging.getLogger("erdma.elastic")
ASK_S = 0.5
MAX_ENTRIES = 4096
MAX_VALUE = 1 << 16
AHEAD = 4
IDLE_S = 0.2
_SET, _SHARE, _ASK = 1, 2, 3
_HEAD = struct.Struct("!BIH")  # kind, epoch, key length; then the key, then the value (a share: u64)
_SHARE_VALUE = struct.Struct("!Q")


def encode(kind: int, epoch: int, key: str, value: bytes = b"") -> bytes:
    k = key.encode()
    return _HEAD.pack(kind, epoch, len(k)) + k + value


def decode(data: bytes) -> tuple[int, int, str, bytes]:
    if len(data) < _HEAD.size:
        raise ProtocolError(f"board: a message of {len(data)} bytes")
    kind, epoch, n = _HEAD.unpack_from(data)
    key, value = data[_HEAD.size:_HEAD.size + n], data[_HEAD.size + n:]
    if kind not in (_SET, _SHARE, _ASK) or len(key) != n or len(value) > MAX_VALUE \
            or (kind == _SHARE and len(value) != _SHARE_VALUE.size):
        raise ProtocolError(f"board: a malformed message (kind {kind}, key {n} bytes, value {len(value)} bytes)")
    return kind, epoch, key.decode(errors="replace"), value


class _Board:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.shares: dict[str, dict[str, int]] = {}
        self.asked: dict[str, float] = {}

    def full(self, key: str) -> bool:
        return key not in self.values and key not in self.shares and len(self.values) + len(self.shares) >= MAX_ENTRIES


class Boards:
    """This member's boards. ``members(epoch)``: the ids of that epoch's members when known here (None:
    not yet: nothing is sent, the caller's asks go out once it is)."""

    def __init__(self, me: str, mailbox: Mailbox, members: Callable[[int], Sequence[str] | None],
                 what: str = "epoch") -> None:
        """``what``: what a board's number counts, for errors ("epoch", "path check")."""
        self.me, self._mailbox, self._members, self._what = me, mailbox, members, what
        self._boards: dict[int, _Board] = {}
        self._floor = 0  # boards of epochs below this are forgotten
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"erdma-board-{me}", daemon=True)
        self._thread.start()

    # ---- the store calls, by epoch ---------------------------------------------------------------------------
    def set(self, epoch: int, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE:
            raise ProtocolError(f"board: a value of {len(value)} bytes for {key!r}; at most {MAX_VALUE}")
        with self._cond:
            board = self._board(epoch, key, own=True)
            if board is None:
                raise ProtocolError(f"board: {self._what} {epoch}'s board cannot take {key!r} (forgotten, or full)")
            board.values[key] = value
            self._cond.notify_all()
        self._send(epoch, encode(_SET, epoch, key, value))

    def get(self, epoch: int, key: str, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                board = self._board(epoch, key, own=True)
                if board is not None and key in board.values:
                    return board.values[key]
                now = time.monotonic()
                if now >= deadline:
                    raise CollectiveTimeoutError(f"elastic: {key!r} of {self._what} {epoch}'s set-up did not come within "
                                                 f"{timeout:.1f}s", op="set-up")
                self._ask(epoch, key, now)
                self._cond.wait(min(deadline - now, IDLE_S))

    def add(self, epoch: int, key: str, amount: int) -> int:
        with self._cond:
            board = self._board(epoch, key, own=True)
            if board is None:
                raise ProtocolError(f"board: {self._what} {epoch}'s board cannot take {key!r} (forgotten, or full)")
            shares = board.shares.setdefault(key, {})
            mine = shares.get(self.me, 0) + amount
            shares[self.me] = mine
            total = sum(shares.values())
            if amount == 0:
                self._ask(epoch, key, time.monotonic())
        if amount:
            self._send(epoch, encode(_SHARE, epoch, key, _SHARE_VALUE.pack(mine)))
        return total

    def forget(self, before: int) -> None:
        """Drop the boards of epochs before ``before`` (their set-ups are over) and refuse them from now on."""
        with self._cond:
            self._floor = max(self._floor, before)
            for e in [e for e in self._boards if e < self._floor]:
                del self._boards[e]

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self._thread.join(IDLE_S + 1.0)

    # ---- inside --------------------------------------------------------------------------------------------
    def _board(self, epoch: int, key: str, own: bool = False) -> _Board | None:
        """(Under the lock.) Epoch ``epoch``'s board, made if needed; None when forgotten, full for a new
        ``key`` or, for what another member sent (not ``own``: this member's own set-up), more than ``AHEAD``
        epochs past the newest board here (a newcomer's first board is its own call's: it may come in late)."""
        if epoch < self._floor or (not own and epoch > max([self._floor, *self._boards]) + AHEAD):
            return None
        board = self._boards.setdefault(epoch, _Board())
        return None if board.full(key) else board

    def _ask(self, epoch: int, key: str, now: float) -> None:
        """(Under the lock.) Ask the epoch's members for ``key`` at most every ASK_S (a mailbox's send only
        queues the message)."""
        board = self._boards.get(epoch)
        if board is None or now - board.asked.get(key, 0.0) < ASK_S:
            return
        board.asked[key] = now
        self._send(epoch, encode(_ASK, epoch, key))

    def _send(self, epoch: int, data: bytes, to: Sequence[str] | None = None) -> None:
        for m in to if to is not None else (self._members(epoch) or ()):
            if m != self.me:
                self._mailbox.send(m, data)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
            got = self._mailbox.recv(IDLE_S)
            if got is None:
                continue
            sender, data = got
            try:
                kind, epoch, key, value = decode(data)
            except ProtocolError as exc:
                log.warning("elastic: a set-up message from %s dropped: %s", sender, exc)
                continue
            answer: list[bytes] = []
            with self._cond:
                board = self._board(epoch, key) if kind != _ASK else self._boards.get(epoch)
                if board is None:
                    continue
                if kind == _SET:
                    board.values[key] = value
                elif kind == _SHARE:
                    shares = board.shares.setdefault(key, {})
                    shares[sender] = max(shares.get(sender, 0), _SHARE_VALUE.unpack(value)[0])
                elif key in board.values:
                    answer.append(encode(_SET, epoch, key, board.values[key]))
                elif self.me in board.shares.get(key, {}):
                    answer.append(encode(_SHARE, epoch, key, _SHARE_VALUE.pack(board.shares[key][self.me])))
                self._cond.notify_all()
            for data in answer:
                self._send(epoch, data, to=(sender,))
