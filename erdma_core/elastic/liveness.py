"""Members' signs of life in the job's store, so that a member that hangs is out in seconds.

Each peer's beat thread gives a sign of life of its own, on a store client of its own (a long wait of the
peer's main thread on its client must not hold its beats back), and judges the epoch's other members'. A
member has *lapsed* when no sign of it came for ``timeout`` seconds (SIGSTOP, a stuck process, a machine gone
without closing its connections), or never came within ``timeout`` of being watched. Then ``on_lapse`` runs
once (the group aborts the epoch's ProcessGroup, so that a collective waiting on that member ends now rather
than at ``timeouts.collective``) and the ballot that follows counts the member dead.

On a store with leases and watches (etcd: ``hold``/``renew``/``set_leased``/``changes``) the sign is a key
``alive/<id>`` under a lease of ``timeout`` seconds: the thread puts a new count in it every ``timeout / 8``
seconds, renews the lease every ``timeout / 4``, and watches every member's key in one watch, so a sign is
heard as it comes. The lease is the store's own judgement on top: when it runs out, etcd deletes the key and
the deletion counts the member out at once (a member that leaves lets its lease run out; it voted itself out
already). The lease alone would not do: etcd's new leader gives every lease its whole TTL again, so a member
stopped just before etcd's leader died would be found an election and a TTL later. On another store (the TCP
store) the sign is a counter under the same key that the thread bumps every ``timeout / 4`` seconds and reads
back for every member. Over the members' own mesh (``MeshSigns``, no store) the count goes to every other
member as a message, and a member's sign is the latest count it sent.

Silence is judged on this peer's clock, so a pause of its own restarts every member's clock: when this peer
was not scheduled, its store did not answer for half the timeout, or (watching) its own new count did not come
back through the watch in the same round (a member cut off from etcd's quorum hears nobody), nobody is judged
on a silence this peer could not have seen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import CollectiveTimeoutError, ErdmaError
from .membership import CasStore, Keys

if TYPE_CHECKING:
    from .mesh import Channel

log = logging.getLogger("erdma.elastic")


class Liveness:
    """Beats for member ``me`` under ``keys`` on ``store`` (a client this object owns and closes); lapses of
    the members given to ``watch``."""

    def __init__(self, store: CasStore, keys: Keys, me: str, timeout: float) -> None:
        self.timeout = timeout
        self._store, self._keys, self._me = store, keys, me
        self._lock = threading.Lock()
        self._members: tuple[str, ...] = ()
        self._on_lapse: Callable[[], None] = lambda: None
        self._on_round: Callable[[], None] = lambda: None
        self._seen: dict[str, tuple[bytes, float]] = {}  # member -> (its last beat, when it last moved)
        self._lapsed: set[str] = set()
        self._stop = threading.Event()
        self._beat = 0
        self.leased = all(callable(getattr(store, f, None)) for f in ("hold", "renew", "set_leased", "changes"))
        self.period = timeout / 8 if self.leased else timeout / 4  # between two beats
        self._lease: int | None = None  # the lease this member's key lives under (a store with leases)
        self._renewed = 0.0
        self._revision = 0  # where the watch of the signs goes on from (0: read what is there first)
        self._beat_once()
        self._thread = threading.Thread(target=self._run, name="erdma-elastic-beat", daemon=True)
        self._thread.start()

    def watch(self, members: tuple[str, ...], on_lapse: Callable[[], None],
              on_round: Callable[[], None] = lambda: None, fresh: bool = False) -> None:
        """From now on, judge ``members`` (this peer's among them is skipped); ``on_lapse()`` runs on the beat
        thread when one lapses, ``on_round()`` after each round of beats (it must not block). A member new to
        the watch gets a whole ``timeout`` from now; with ``fresh`` every member does, lapsed ones too (this
        peer joins again: the members that decided its epoch heard each other since it last did, behind a
        partition or while it was stopped)."""
        now = time.monotonic()
        with self._lock:
            self._members = tuple(m for m in members if m != self._me)
            self._seen = {m: (self._seen.get(m, (b"", now))[0], now) if fresh else self._seen.get(m, (b"", now))
                          for m in self._members}
            self._lapsed = set() if fresh else self._lapsed & set(self._members)
            self._on_lapse, self._on_round = on_lapse, on_round

    def lapsed(self) -> set[str]:
        with self._lock:
            return set(self._lapsed)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.timeout)
        close = getattr(self._store, "close", None)
        if close is not None:
            close()

    def _beat_once(self) -> None:
        key = self._keys("alive", self._me)
        self._beat += 1
        beat = str(self._beat).encode()
        if not self.leased:
            self._store.set(key, beat)
            return
        store: Any = self._store
        now = time.monotonic()
        if self._lease is not None and now - self._renewed < self.timeout / 4:
            try:
                store.set_leased(key, beat, self._lease)
                return
            except ErdmaError:  # etcd no longer has the lease ("requested lease not found"): see below
                self._renewed = 0.0
        if self._lease is not None and store.renew(self._lease):
            self._renewed = now
            store.set_leased(key, beat, self._lease)
            return
        if self._lease is not None:  # it ran out: the others may have counted this member out (it finds out
            # at its next ballot and joins again); a sign of life from now on, for whoever watches it next
            log.warning("elastic: this member's lease in the store ran out (it did not run for %.1fs)", self.timeout)
        self._lease, self._renewed = store.hold(key, beat, self.timeout), now

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            try:
                self._beat_once()
                heard = self._listen() if self.leased else self._poll()
            except ErdmaError as exc:  # the store is away: no judgement on what could not be read
                log.debug("elastic: a beat or a read of the others' failed: %s", exc)
                heard = None
                self._stop.wait(self.period)
            now = time.monotonic()
            paused = now - last > self.timeout / 2 or heard is None
            last = now
            if heard is not None:
                self._judge(*heard, now, paused)
            with self._lock:
                on_round = self._on_round
            on_round()

    def _poll(self) -> tuple[set[str], set[str], bool]:
        """(members whose counter moved, members gone, whether this peer heard itself) on a store without
        watches: wait a period, then read every member's counter."""
        self._stop.wait(self.period)
        with self._lock:
            members, seen = self._members, dict(self._seen)
        moved = set()
        for m in members:
            try:
                beat = self._store.get(self._keys("alive", m), 0.0)
            except CollectiveTimeoutError:
                continue
            if m in seen and beat != seen[m][0]:
                moved.add(m)
                with self._lock:
                    if m in self._seen:
                        self._seen[m] = (beat, self._seen[m][1])
        return moved, set(), True

    def _listen(self) -> tuple[set[str], set[str], bool]:
        """(members heard, members whose key etcd deleted, whether this peer's own new count came back) over a
        period of watching every member's key."""
        store: Any = self._store
        events, self._revision = store.changes(self._keys("alive") + "/", self._revision, self.period)
        heard, gone = set(), set()
        for member, value in events:
            if value is None:
                gone.add(member)
                heard.discard(member)
            else:
                heard.add(member)
                gone.discard(member)
        return heard, gone, self._me in heard

    def _judge(self, heard: set[str], gone: set[str], me: bool, now: float, paused: bool) -> None:
        new: list[str] = []
        paused = paused or not me  # a watch that did not bring back this peer's own beat heard nobody
        with self._lock:
            for m in self._members:
                if m not in self._seen:
                    continue
                beat, since = self._seen[m]
                if m in heard or (paused and m not in gone):
                    self._seen[m] = (beat, now)
                elif (m in gone or now - since > self.timeout) and m not in self._lapsed:
                    self._lapsed.add(m)
                    new.append(m)
            on_lapse = self._on_lapse
        if new:
            log.warning("elastic: no sign of life from member(s) %s for %.1fs (elastic.liveness_timeout): "
                        "counting them out", ", ".join(new), self.timeout)
            on_lapse()


class MeshSigns:
    """The store calls ``Liveness`` makes (``set`` of its own sign, ``get`` of another's), over a channel of the
    members' mesh instead of a store: ``set`` sends the count to every member ``peers()`` names, ``get`` answers
    with the latest count that member sent (the mesh proved who sent it). Nothing waits."""

    def __init__(self, channel: Channel, peers: Callable[[], tuple[str, ...]]) -> None:
        self._channel, self._peers = channel, peers
        self._latest: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        me = key.rpartition("/")[2]
        for m in self._peers():
            if m != me:
                self._channel.send(m, value)

    def get(self, key: str, timeout: float) -> bytes:
        while (got := self._channel.recv(0.0)) is not None:
            self._latest[got[0]] = got[1]
        member = key.rpartition("/")[2]
        if member not in self._latest:
            raise CollectiveTimeoutError(f"elastic: no sign of life from member {member} over the mesh yet")
        return self._latest[member]

    def close(self) -> None:
        self._channel.close()
