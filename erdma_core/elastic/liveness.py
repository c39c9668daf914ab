"""Members' signs of life in the job's store, so that a member that hangs is out in seconds.

Each peer's beat thread renews its own sign of life every ``timeout / 4`` seconds, on a store client of its own
(a long wait of the peer's main thread on its client must not hold its beats back). On a store with leases
(etcd: ``hold``/``renew``) the sign is a key ``alive/<id>`` under a lease of ``timeout`` seconds that the thread
keeps alive: the store deletes the key when the lease runs out, so the store itself, not a reader's clock,
judges a member that stopped. A member that leaves lets its lease run out (it voted itself out already: the
others need not hear it from the store too). On another store (the TCP store) the sign is a counter under the
same key that the thread bumps.

The same thread reads the signs of the epoch's other members. A member has *lapsed* when its leased key is gone
(or never appeared within ``timeout`` of being watched), or when its counter has not moved for ``timeout``
seconds (SIGSTOP, a stuck process, a machine gone without closing its connections). Then ``on_lapse`` runs once
(the group aborts the epoch's ProcessGroup, so that a collective waiting on that member ends now rather than at
``timeouts.collective``) and the ballot that follows counts the member dead. With counters, a pause of this
peer's own (it was not scheduled, or its store did not answer for half the timeout) restarts every member's
clock: nobody is judged on a silence this peer could not have seen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import CollectiveTimeoutError, ErdmaError
from .membership import CasStore, Keys

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
        self._seen: dict[str, tuple[bytes, float]] = {}  # member -> (its last beat, when it last moved)
        self._lapsed: set[str] = set()
        self._stop = threading.Event()
        self._beat = 0
        self.leased = all(callable(getattr(store, f, None)) for f in ("hold", "renew"))
        self._lease: int | None = None  # the lease this member's key lives under (a store with leases)
        self._beat_once()
        self._thread = threading.Thread(target=self._run, name="erdma-elastic-beat", daemon=True)
        self._thread.start()

    def watch(self, members: tuple[str, ...], on_lapse: Callable[[], None]) -> None:
        """From now on, judge ``members`` (this peer's among them is skipped); ``on_lapse()`` runs on the beat
        thread when one lapses. A member new to the watch gets a whole ``timeout`` from now."""
        now = time.monotonic()
        with self._lock:
            self._members = tuple(m for m in members if m != self._me)
            self._seen = {m: self._seen.get(m, (b"", now)) for m in self._members}
            self._lapsed &= set(self._members)
            self._on_lapse = on_lapse

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
        if not self.leased:
            self._beat += 1
            self._store.set(key, str(self._beat).encode())
            return
        store: Any = self._store
        if self._lease is not None and store.renew(self._lease):
            return
        if self._lease is not None:  # it ran out: the others may have counted this member out (it finds out
            # at its next ballot and joins again); a sign of life from now on, for whoever watches it next
            log.warning("elastic: this member's lease in the store ran out (it did not run for %.1fs)", self.timeout)
        self._lease = store.hold(key, b"alive", self.timeout)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.timeout / 4):
            try:
                self._beat_once()
                with self._lock:
                    members = self._members
                beats = {m: self._read(m) for m in members}
            except ErdmaError as exc:  # the store is away: no judgement on what could not be read
                log.debug("elastic: a beat or a read of the others' failed: %s", exc)
                beats = None
            now = time.monotonic()
            paused = now - last > self.timeout / 2 or beats is None
            last = now
            if beats is not None:
                self._judge(beats, now, paused)

    def _read(self, member: str) -> bytes:
        try:
            return self._store.get(self._keys("alive", member), 0.0)
        except CollectiveTimeoutError:
            return b""

    def _judge(self, beats: dict[str, bytes], now: float, paused: bool) -> None:
        new: list[str] = []
        with self._lock:
            for m, beat in beats.items():
                if m not in self._seen:
                    continue  # no longer watched
                before, since = self._seen[m]
                # with leases the store judged (a key that was there and is gone: its lease ran out); with
                # counters, one that has not moved for the timeout, unless this peer paused
                alive = bool(beat) if self.leased else (beat != before or paused)
                if alive:
                    self._seen[m] = (beat, now)
                elif ((self.leased and before) or now - since > self.timeout) and m not in self._lapsed:
                    self._lapsed.add(m)
                    new.append(m)
            on_lapse = self._on_lapse
        if new:
            log.warning("elastic: no sign of life from member(s) %s for %.1fs (elastic.liveness_timeout): "
                        "counting them out", ", ".join(new), self.timeout)
            on_lapse()
