"""One job on two transports, each pair of ranks on the first that connects it (``transport.fallback``).

Both transports check every pair at once. The first (the built-in TCP, meeting its peers through their NATs)
tries each pair for one check of the pair's candidates, with no error for a pair it cannot meet; the two ends of
each pair then agree on what they met (``settle``: each publishes the peers it connected, and a pair is kept
only where both ends list each other, so a handshake that ended on one side only is closed on both).
Meanwhile, on a thread of its own, the second (erdma-quic, direct or through a TURN relay) connects to every
peer; once the first has settled, it lets go of the pairs the first kept (``ctx.taken``: both ends know them
from the same published lists) and waits only for the rest. A pair TCP cannot meet is thus on QUIC about
when TCP gives it up, not one QUIC check later. One group runs on both:
every send, receive and wait goes to the transport of its peer, and a failure of either aborts the other, so
every rank hears of it. Each transport authenticates and seals its own pairs as it does alone.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import attrs

from ..errors import CollectiveTimeoutError, ConfigError
from ..net.addresses import publish_paths
from ..wire import Header
from .base import MessageTransport, TransportContext, await_key
from .request import Request

log = logging.getLogger("erdma.transport")
LOOK_S = 0.5  # seconds a wait on one transport runs before it looks whether the other one failed
BESIDE_SLACK_S = 5.0  # seconds past the connect timeout the second transport's set-up may take to end


class PairedTransport:
    """A ``Transport`` over ``first`` (which must honour ``ctx.settle``) and ``second`` (which must honour
    ``ctx.peers`` and ``ctx.taken``)."""

    streams = True  # ``first`` meets peers over TCP: set-up hands the traversal's TCP socket (``ctx.tcp_socket``)

    def __init__(self, first: MessageTransport, second: MessageTransport) -> None:
        self.parts = (first, second)
        self.name = f"{first.name}+{second.name}"
        self.devices = first.devices & second.devices
        self.stripes = 1
        self.rank, self.world_size = -1, 0
        self.via: dict[int, int] = {}  # peer -> 0 (first) or 1 (second)
        self._used: list[MessageTransport] = []

    # ---- set-up -------------------------------------------------------------------------------------
    def connect(self, ctx: TransportContext) -> None:
        self.rank, self.world_size = ctx.rank, ctx.world_size
        first, second = self.parts
        deadline = time.monotonic() + ctx.connect_timeout
        others = frozenset(p for p in range(ctx.world_size) if p != ctx.rank)
        kept: set[int] = set()
        decided: list[frozenset[int]] = []  # the pairs the first kept, once both ends of each agreed
        stopped: list[BaseException] = []  # why the first one's set-up failed
        failed: list[BaseException] = []  # why the second one's did

        def settle(connected: set[int]) -> set[int]:
            kept.update(self._settle(ctx, connected, deadline))
            return kept

        def taken() -> frozenset[int] | None:
            if stopped:
                raise ConfigError(f"rank {ctx.rank}: set-up stopped: {first.name}: {stopped[0]}")
            return decided[0] if decided else None

        def beside() -> None:
            try:
                udp = ctx.open_udp() if ctx.open_udp is not None else ctx.udp_socket
                second.connect(attrs.evolve(ctx, peers=others, udp_socket=udp, tcp_socket=None, open_udp=None,
                                            settle=None, taken=taken, publish_paths=lambda: self._publish(ctx)))
            except BaseException as exc:
                failed.append(exc)

        checking = threading.Thread(target=beside, name=f"erdma-paired-{ctx.rank}", daemon=True)
        checking.start()
        try:
            first.connect(attrs.evolve(ctx, udp_socket=None, open_udp=None, settle=settle, publish_paths=False))
        except BaseException as exc:
            stopped.append(exc)  # (the second stops at its next look at ``taken``, and closes itself)
            checking.join(ctx.connect_timeout + BESIDE_SLACK_S)
            raise
        self._used.append(first)
        decided.append(frozenset(kept))
        rest = others - kept
        self.via = {p: 0 for p in kept} | {p: 1 for p in rest}
        checking.join(max(0.0, deadline - time.monotonic()) + BESIDE_SLACK_S)
        error = failed[0] if failed else None
        if checking.is_alive():
            error = CollectiveTimeoutError(f"rank {ctx.rank}: {second.name}'s set-up beside {first.name} did not end "
                                           f"within {ctx.connect_timeout:.1f}s", rank=ctx.rank, op="connect")
        if error is not None and rest:
            first.abort(error)
            first.close()
            raise error
        if error is not None:
            log.debug("rank %d: %s, needed for no pair, failed beside %s: %s", ctx.rank, second.name, first.name,
                      error)
        elif rest:
            log.info("rank %d: %s for ranks %s, %s for ranks %s", ctx.rank, first.name, sorted(kept), second.name,
                     sorted(rest))
            self._used.append(second)
        else:
            second.close()  # (it lets go of every pair: nothing to tell anyone)
        self.stripes = max(t.stripes for t in self._used)
        self._publish(ctx)

    def _settle(self, ctx: TransportContext, connected: set[int], deadline: float) -> set[int]:
        """The peers of ``connected`` that connected with this rank too, by what each published."""
        ctx.store.set(f"paired/{ctx.rank}", ",".join(map(str, sorted(connected))).encode())

        def gave_up(why: str) -> Exception:
            return ConfigError(f"rank {ctx.rank}: set-up stopped: {why}")

        kept = set()
        for peer in sorted(connected):
            theirs = await_key(ctx, f"paired/{peer}", deadline, gave_up).decode()
            if str(ctx.rank) in theirs.split(","):
                kept.add(peer)
        return kept

    def _publish(self, ctx: TransportContext) -> None:
        """Log and publish (``paths/RANK``, for erdma doctor) each peer's path and transport."""
        paths = self.paths()
        (log.warning if any(" relayed " in p for p in paths.values()) else log.info)(
            "rank %d: paths to its peers: %s", self.rank, ", ".join(f"rank {r} at {p}" for r, p in sorted(paths.items())))
        try:
            publish_paths(ctx.store, self.rank, paths)
        except Exception as exc:  # the store is best effort here: the log above is what is left
            log.debug("rank %d: paths not published: %s", self.rank, exc)

    # ---- what the pairs use ---------------------------------------------------------------------------
    def paths(self) -> dict[int, str]:
        """Per peer: ``HOST:PORT direct|relayed TRANSPORT`` (the transport's own path, and its name)."""
        out: dict[int, str] = {}
        for t in self._used:
            theirs: dict[int, str] = getattr(t, "paths", dict)()
            for peer in t.peers():
                out[peer] = f"{theirs.get(peer, '? direct')} {t.name}"
        return out

    def slow_peers(self) -> set[int]:
        """The peers the second transport reaches through a relay (as it says). Always a set, also on a rank
        whose pairs all met over the first: the ranks agree on the slow links at set-up, each saying its own."""
        found = [s() for t in self._used if callable(s := getattr(t, "slow_peers", None))]
        return set().union(*(s for s in found if s is not None))

    def link_rate(self, peer: int) -> float | None:
        return self.parts[self.via[peer]].link_rate(peer)

    # ---- the Transport calls ------------------------------------------------------------------------------
    def isend(self, peer: int, header: Header, data: memoryview, deadline: float) -> Request:
        i = self.via[peer]
        req = self.parts[i].isend(peer, header, data, deadline)
        req.via = i
        return req

    def irecv(self, peer: int, header: Header, out: memoryview) -> Request:
        i = self.via[peer]
        req = self.parts[i].irecv(peer, header, out)
        req.via = i
        return req

    def wait(self, req: Request, deadline: float) -> bool:
        """On the transport that made ``req``; a failure of the other one is taken over meanwhile."""
        t = self.parts[req.via]
        while True:
            if t.wait(req, min(deadline, time.monotonic() + LOOK_S)):
                return True
            self.failure()  # (a failure of the other one is passed on to this one)
            if time.monotonic() >= deadline:
                return False

    def begin(self, group: int, seq: int) -> None:
        self.failure()
        for t in self._used:
            t.begin(group, seq)

    def abort(self, error: BaseException) -> None:
        for t in self._used:
            t.abort(error)

    def failure(self) -> BaseException | None:
        """What failed either transport (a lost peer, a peer's ABORT). The other one is aborted with it here,
        without waiting (its peers are told), whoever asks: a collective's wait and begin, or, between
        collectives, an elastic member's beat thread every round, so that a rank whose peers are all on the
        other transport learns of a loss from this rank's word, not from its own timeouts."""
        error = next((e for t in self._used if (e := t.failure()) is not None), None)
        if error is not None:
            for t in self._used:
                if t.failure() is None:
                    t.abort(error, wait=False)
        return error

    def heard(self, peer: int, group: int, seq: int) -> bool:
        return self.parts[self.via[peer]].heard(peer, group, seq)

    def close(self) -> None:
        for t in self._used:
            t.close()

    def counters(self) -> dict[str, Any]:
        """How many peers each transport carries, and how many of them through a relay."""
        slow = self.slow_peers()
        out = {f"transport.{t.name.lower()}.peers": len(t.peers()) for t in self._used}
        out["transport.relayed.peers"] = len(slow)
        return out
