"""Sans-IO message matching shared by transports: posted receives meet arriving frames by key.

The inbound steps have the names ``FrameInbox`` gives them: a transport's reader calls ``frame`` when a
frame header arrives and gets back the buffer to read the payload into (the posted receive's own memory when
one is waiting and the payload is raw, so large messages land in place) and a token, then ``landed(token)``
once the payload is in; a reader that has a whole frame at once (small frames) calls ``whole``. An encoded
payload (a compressor's, ``codec`` in the header) lands in a buffer of its own, bounded by what the receive
expects, and the completed request carries it for the engine to decode. A message a peer lends (``lent``: it
stays in the peer's memory,
``single_copy``) is read by the transport's ``pull`` straight into the receive's memory once that receive
is posted. The collective side calls ``post_recv`` / ``begin``. No sockets here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..errors import MismatchError, ProtocolError, gone_ranks
from ..protocol import dtypes, ops, reduce_ops
from ..protocol.limits import encoded_limit
from ..wire import NO_ROOT, OP_FIELDS, P2P_GROUP_BIT, RAW, SIZE_FIELDS, Header
from .request import Request


class _Posted:
    __slots__ = ("meta", "out", "req")

    def __init__(self, meta: Header, out: memoryview, req: Request) -> None:
        self.meta, self.out, self.req = meta, out, req


class Lent(NamedTuple):
    """A message a peer lends: ``address`` in its process, the ``ticket`` its PULLED answer names."""

    address: int
    ticket: int


Pull = Callable[[int, Lent, "memoryview | None"], "BaseException | None"]
"""``pull(peer, lent, out)``: read a lent message into ``out`` (None: not wanted, only give it back) and tell
the peer its memory is free; returns the error that fails the receive, or None."""


class _Early:
    """A frame that arrived before its receive was posted; ``waiter`` is a receive posted mid-payload.
    A lent frame (``lent``) holds no payload here: it has landed as soon as it came."""

    __slots__ = ("data", "header", "landed", "lent", "waiter")

    def __init__(self, header: Header, data: memoryview | None, lent: Lent | None = None,
                 landed: bool = False) -> None:
        self.header, self.data, self.landed, self.lent = header, data, landed or lent is not None, lent
        self.waiter: _Posted | None = None


Key = tuple[int, tuple[int, int, int]]  # (peer, (group, seq, tag))


class Deliver(NamedTuple):
    """A frame matched to a posted receive: once it has landed, the receive completes (with ``error``, the
    reason it cannot be used, if any)."""

    key: Key
    error: BaseException | None


class Hold(NamedTuple):
    """A frame no receive was posted for yet: once it has landed, it waits in ``early`` (None: a lent one,
    whose bytes stay with the peer) for its receive."""

    key: Key
    early: _Early | None


Token = Deliver | Hold | None  # None: nothing to do once the payload is in (dropped)


def describe(h: Header) -> str:
    red = f", op={reduce_ops.NAMES.get(h.redop, h.redop)}" if h.redop else ""
    root = f", root={h.root}" if h.root != NO_ROOT else ""
    return f"{ops.name_of(h.opcode)}(dtype={dtypes.name_of(h.dtype)}, numel={h.numel}, count={h.count}{red}{root})"


def check_match(rank: int, peer: int, expected: Header, got: Header) -> MismatchError | ProtocolError | None:
    """``expected``: the receive's header (raw: ``nbytes`` is its memory); ``got``: the arriving frame's."""
    same_op = got[OP_FIELDS] == expected[OP_FIELDS] and got[SIZE_FIELDS] == expected[SIZE_FIELDS]
    if same_op and got.nbytes == expected.nbytes and got.codec == RAW:
        return None  # the common case: the same op and size, raw payload
    if not same_op:
        op = ops.name_of(expected.opcode)
        return MismatchError(f"rank {rank}: {op} mismatch between ranks {rank} and {peer}: rank {rank} called "
                             f"{describe(expected)}, rank {peer} called {describe(got)}", rank=rank, op=op)
    if got.codec == RAW and got.nbytes != expected.nbytes:
        return ProtocolError(f"rank {rank}: rank {peer} sent {got.nbytes} raw bytes for {got.count} elements of "
                             f"{dtypes.name_of(got.dtype)}; {expected.nbytes} expected")
    if got.codec != RAW and got.nbytes > encoded_limit(expected.nbytes):
        return ProtocolError(f"rank {rank}: rank {peer} sent {got.nbytes} encoded bytes for {expected.nbytes} "
                             f"raw bytes (at most {encoded_limit(expected.nbytes)} allowed)")
    return None


DEFAULT_EARLY_BYTES = 1 << 30


class Mailbox:
    """Thread-safe matching of (peer, group, seq, tag) keys; rejects stale and foreign frames. A frame that
    arrives before its receive is held in memory of its own, at most ``early_bytes`` per peer
    (``security.max_early_bytes``): a peer that claims more is breaking the protocol, and nothing is
    allocated for it. That memory is used again for later early frames once copied out (``Spares``)."""

    def __init__(self, rank: int, job: int, early_bytes: int = DEFAULT_EARLY_BYTES,
                 on_mismatch: Callable[[MismatchError], None] | None = None, pull: Pull | None = None) -> None:
        """``on_mismatch(error)``: a peer sent a collective's message this rank can never receive (it ran
        another collective at that sequence number, or the same with another root or size); the transport
        aborts the job with it. Without it, the error fails this mailbox only. ``pull``: how the transport
        reads a lent message (None: it lends nothing, and a lent frame breaks the protocol)."""
        self.rank = rank
        self.on_mismatch = on_mismatch
        self.pull = pull
        self.job32 = job & 0xFFFFFFFF
        self.early_limit = early_bytes
        self._early_bytes: dict[int, int] = {}  # peer -> bytes held for frames that came before their receive
        self._lock = threading.Lock()
        self._posted: dict[Key, _Posted] = {}
        self._unexpected: dict[Key, _Early] = {}
        self._inflight: dict[Key, Request] = {}  # matched, payload still arriving
        self._floor: dict[int, int] = {}  # group -> lowest sequence still live
        self._gone: dict[int, BaseException] = {}  # peers that closed: nothing more will come from them
        self._lent: dict[tuple[int, int], tuple[Request, memoryview]] = {}  # (peer, ticket): our sends it reads
        self._tickets = 0
        self._spares = Spares()  # memory of delivered early frames, for the next ones
        self._heard: dict[tuple[int, int], int] = {}  # (peer, group) -> latest sequence a frame came for
        self.aborted: BaseException | None = None
        # peers a close after an abort does not wait on: those whose ABORT came (tearing down too), the one a loss
        # named, those the caller's abort said are gone
        self.unwaited: set[int] = set()
        self.rejected = 0

    def heard(self, peer: int, group: int, seq: int) -> bool:
        """Whether a frame of collective ``seq`` of ``group`` (or of a later one) came from ``peer``: it has
        called that collective. Nothing from a peer that this rank waits on says less: it has not called it,
        or it waits on another rank before it sends."""
        return self._heard.get((peer, group), 0) >= seq

    def begin(self, group: int, seq: int) -> MismatchError | None:
        """A collective ``seq`` starts in ``group``. A frame of an older sequence that no receive took means
        the ranks disagreed on that collective: returns the error (and later ones count as such too)."""
        with self._lock:
            self._floor[group] = seq
            old = []
            for k in self._unexpected:  # usually empty, or the frames of this op that came first
                if k[1][0] == group and k[1][1] < seq:
                    old.append(k)
            if not old:
                return None
            stale = [(k[0], self._unexpected.pop(k)) for k in old]
            for peer, early in stale:
                self._release(peer, early)
                self.rejected += 1
        self._give_back(stale)
        return self._never_received(stale[0][0], stale[0][1].header)

    def stray(self, group: int, seq: int) -> MismatchError | None:
        """A frame of collective ``seq`` of ``group`` waiting with no receive, while this rank runs that
        collective on a transport's own path (``Transport.run_program``), which posts none: its sender ran
        another collective there (or the same with another root or size). The error, or None."""
        with self._lock:
            for k, early in self._unexpected.items():
                if k[1][0] == group and k[1][1] == seq:
                    return self._never_received(k[0], early.header)
        return None

    def _never_received(self, peer: int, h: Header) -> MismatchError:
        return MismatchError(f"rank {self.rank}: rank {peer} sent a message of collective #{h.seq} of group {h.group} "
                             f"({describe(h)}) that this rank never received: the ranks called different collectives "
                             "there, or the same one with different roots, sizes or algorithms",
                             rank=self.rank, op=ops.name_of(h.opcode))

    def _mismatch(self, error: MismatchError) -> None:
        if self.on_mismatch is not None:
            self.on_mismatch(error)
        else:
            self.abort(error)

    def post_recv(self, peer: int, meta: Header, out: memoryview) -> Request:
        req = Request()
        with self._lock:
            if self.aborted is not None:
                req.complete(self.aborted)
                return req
            key = (peer, (meta.group, meta.seq, meta.tag))
            if key in self._posted:
                raise ProtocolError(f"rank {self.rank}: a receive from rank {peer} with key {meta.key} is already posted")
            early = self._unexpected.get(key)
            if early is None and peer in self._gone:  # what it sent before closing is still delivered above
                req.complete(self._gone[peer])
                return req
            if early is None:
                self._posted[key] = _Posted(meta, out, req)
                return req
            if not early.landed:  # its payload is still being read: landed() will deliver
                early.waiter = _Posted(meta, out, req)
                return req
            self._release(peer, self._unexpected.pop(key))
        self._deliver(peer, _Posted(meta, out, req), early)
        return req

    def lend(self, peer: int, req: Request, payload: memoryview) -> int | None:
        """A send whose ``payload`` ``peer`` will read from this rank's memory: the ticket its PULL frame
        carries (``req`` completes when the peer gives it back), or None when this rank has aborted (``req``
        failed). The payload is kept referenced until then."""
        with self._lock:
            if self.aborted is None and peer not in self._gone:
                self._tickets += 1
                self._lent[(peer, self._tickets)] = (req, payload)
                return self._tickets
            error = self.aborted or self._gone[peer]
        req.complete(error)
        return None

    def returned(self, peer: int, ticket: int) -> None:
        """``peer`` has read (or will never read) the send lent under ``ticket``: it is done."""
        with self._lock:
            lent = self._lent.pop((peer, ticket), None)
        if lent is None:
            if self.aborted is not None:
                return  # failed already
            raise ProtocolError(f"rank {self.rank}: rank {peer} gave back ticket {ticket}, which was not lent to it")
        lent[0].complete()

    def fail_lent(self, peer: int, error: BaseException) -> None:
        """The connection to ``peer`` ended: what it had not read yet never will be."""
        with self._lock:
            failed = self._take_lent(peer)
        for req in failed:
            req.complete(error)

    def _take_lent(self, peer: int) -> list[Request]:
        """The sends lent to ``peer`` and not given back, taken out (lock held)."""
        return [self._lent.pop(k)[0] for k in [k for k in self._lent if k[0] == peer]]

    def frame(self, peer: int, h: Header, lent: Lent | None = None) -> tuple[memoryview | None, Token]:
        """Return ``(buffer, token)``: read ``h.nbytes`` into ``buffer`` (None: discard), then ``landed(token)``.
        ``lent``: the payload stays in the peer's memory (``lent``); an early one is held as it is."""
        if h.job & 0xFFFFFFFF != self.job32:
            raise ProtocolError(f"rank {self.rank}: frame from rank {peer} carries job {h.job:#x}, "
                                f"this job is {self.job32:#x}")
        clash: _Posted | None = None
        with self._lock:
            key = (peer, (h.group, h.seq, h.tag))
            if h.seq > self._heard.get((peer, h.group), 0):
                self._heard[(peer, h.group)] = h.seq
            collective = not h.group & P2P_GROUP_BIT
            floor = self._floor.get(h.group, 0)
            stale = collective and h.seq < floor
            if stale:
                self.rejected += 1
            posted = None if stale else self._posted.pop(key, None)
            if posted is None and collective and h.seq == floor:  # the op under way here: does it agree?
                clash_key = next((k for k, p in self._posted.items() if k[1][0] == h.group and k[1][1] == h.seq
                                  and (p.meta[OP_FIELDS] != h[OP_FIELDS] or p.meta.numel != h.numel)), None)
                if clash_key is not None:
                    clash = self._posted.pop(clash_key)
            if posted is None and not stale and clash is None and lent is not None:
                self._unexpected[key] = _Early(h, None, lent)  # nothing held here: the peer keeps the bytes
                return None, Hold(key, None)
            if posted is None and not stale and clash is None:
                self._hold_early(peer, h)
                early = _Early(h, self._spares.take(h.nbytes))
                self._unexpected[key] = early
                return early.data, Hold(key, early)
            if posted is not None:
                self._inflight[key] = posted.req  # abort() must still reach it while its payload arrives
        if stale:  # a message of a collective this rank has finished: nobody here will ever take it
            self._mismatch(self._never_received(peer, h))
            return None, None
        if clash is not None:  # another rank runs this sequence number as another op, root or size
            clash.req.complete(check_match(self.rank, peer, clash.meta, h))
            return None, None
        assert posted is not None
        err = check_match(self.rank, peer, posted.meta, h)
        if err is not None:
            return None, Deliver(key, err)
        if h.codec != RAW:
            staged = memoryview(bytearray(h.nbytes))
            posted.req.encoded = (h, staged)
            return staged, Deliver(key, None)
        return posted.out, Deliver(key, None)

    def whole(self, peer: int, h: Header, payload: memoryview) -> None:
        """A whole frame at once (a reader that has the payload already): ``frame``, the copy and
        ``landed`` in one step. The common case, a raw frame whose receive is posted and agrees with
        it, takes the lock once; anything else goes the long way."""
        if h.codec == RAW and h.job & 0xFFFFFFFF == self.job32:
            key = (peer, (h.group, h.seq, h.tag))
            with self._lock:
                if h.seq > self._heard.get(pg := (peer, h.group), 0):
                    self._heard[pg] = h.seq
                posted = self._posted.get(key)
                if posted is None:
                    if self._keep_early(peer, h, key, payload):
                        return
                elif (posted.meta.nbytes != h.nbytes or posted.meta[OP_FIELDS] != h[OP_FIELDS]
                      or posted.meta[SIZE_FIELDS] != h[SIZE_FIELDS]
                      or (not h.group & P2P_GROUP_BIT and h.seq < self._floor.get(h.group, 0))):
                    posted = None
                else:
                    del self._posted[key]
            if posted is not None:
                if h.nbytes:
                    posted.out[:] = payload
                posted.req.complete()
                return
        buf, token = self.frame(peer, h)
        if buf is not None and h.nbytes:
            buf[:h.nbytes] = payload
        self.landed(token)

    def _keep_early(self, peer: int, h: Header, key: Key, payload: memoryview) -> bool:
        """(Lock held.) A small raw frame with no receive posted for it, kept whole until one is; False where
        ``frame`` must judge it (stale, a posted receive of the same op to check it against, large).
        Over the early limit it is refused here as there."""
        group, seq, nbytes = h.group, h.seq, h.nbytes
        if nbytes >= Spares.SMALL:
            return False
        if not group & P2P_GROUP_BIT:
            floor = self._floor.get(group, 0)
            if seq < floor or (seq == floor and self._posted and any(k[1][0] == group for k in self._posted)):
                return False
        self._hold_early(peer, h)
        self._unexpected[key] = _Early(h, memoryview(bytearray(payload)), landed=True)  # small: never a spare
        return True

    def _hold_early(self, peer: int, h: Header) -> None:
        """(Lock held.) Count an early frame's payload against ``peer``'s budget, or refuse the frame."""
        held = self._early_bytes.get(peer, 0) + h.nbytes
        if held > self.early_limit:
            raise ProtocolError(f"rank {self.rank}: rank {peer} sent {held} bytes ahead of their receives "
                                f"({describe(h)}, {h.nbytes} bytes); at most {self.early_limit} are held "
                                "(security.max_early_bytes)")
        self._early_bytes[peer] = held

    def lent(self, peer: int, h: Header, lent: Lent) -> None:
        """A DATA frame whose ``h.nbytes`` raw payload bytes ``peer`` lends: read into its receive now when
        that is posted, else once it is (``post_recv``); given back unread when nobody will receive it."""
        if self.pull is None:
            raise ProtocolError(f"rank {self.rank}: rank {peer} lent a message over a connection that cannot read it")
        if h.codec != RAW:
            raise ProtocolError(f"rank {self.rank}: rank {peer} lent an encoded message (codec {h.codec:#x})")
        buf, token = self.frame(peer, h, lent)
        if isinstance(token, Hold):
            return
        error = self.pull(peer, lent, buf)
        if error is not None and token is not None:
            token = token._replace(error=error)
        self.landed(token)

    def landed(self, token: Token) -> None:
        """The payload ``frame`` gave a buffer for is in."""
        if token is None:
            return
        if isinstance(token, Deliver):
            with self._lock:
                req = self._inflight.pop(token.key, None)
            if req is not None:
                req.complete(token.error)
            return
        key, early = token
        if early is None:  # a lent frame's bytes stay with the peer until its receive is posted
            return
        with self._lock:
            early.landed = True
            if early.waiter is None:
                return
            if self._unexpected.pop(key, None) is not None:
                self._release(key[0], early)
        self._deliver(key[0], early.waiter, early)

    def waiting_on(self) -> set[int]:
        """The peers this rank has posted receives for that have not completed (a transport that cannot
        hear a peer die probes these)."""
        with self._lock:
            peers = {k[0] for k in self._posted} | {k[0] for k in self._inflight}
            return peers | {k[0] for k, e in self._unexpected.items() if e.waiter is not None}

    def _release(self, peer: int, early: _Early) -> None:
        """An early frame left the mailbox (delivered or dropped): its bytes no longer count (lock held)."""
        if early.lent is None:
            self._early_bytes[peer] -= early.header.nbytes

    def _give_back(self, dropped: list[tuple[int, _Early]]) -> None:
        """Lent frames nobody will receive: their memory is the peers' again (lock not held)."""
        for peer, early in dropped:
            if early.lent is not None and self.pull is not None:
                self.pull(peer, early.lent, None)

    def _deliver(self, peer: int, posted: _Posted, early: _Early) -> None:
        err = check_match(self.rank, peer, posted.meta, early.header)
        if early.lent is not None:
            error = self.pull(peer, early.lent, None if err else posted.out)  # type: ignore[misc]
            posted.req.complete(err or error)
            return
        if err is None:
            assert early.data is not None  # held here: not lent
            if early.header.codec != RAW:
                posted.req.encoded = (early.header, early.data)
            else:
                posted.out[:] = early.data
                self._spares.give(early.data)
        posted.req.complete(err)

    def peer_gone(self, peer: int, error: BaseException) -> None:
        """``peer`` closed in good order: fail what still waits for data from it, and later receives from it."""
        with self._lock:
            self._gone[peer] = error
            posted = [self._posted.pop(k) for k in [k for k in self._posted if k[0] == peer]]
            inflight = [self._inflight.pop(k) for k in [k for k in self._inflight if k[0] == peer]]
            waiters = [e.waiter for k, e in self._unexpected.items() if k[0] == peer and e.waiter is not None]
            lent = self._take_lent(peer)
        for req in [p.req for p in posted] + inflight + [w.req for w in waiters] + lent:
            req.complete(error)

    def aborted_by(self, peer: int, error: BaseException) -> None:
        """``peer``'s ABORT came (``error`` says why): ``abort`` with it, and count ``peer`` among those tearing
        down, whose acknowledgements a closing transport need not wait for (``unwaited``)."""
        with self._lock:
            self.unwaited.add(peer)
        self.abort(error)

    def abort(self, error: BaseException) -> None:
        """Fail every posted receive and every later one with ``error`` (first cause wins). The ranks it names
        gone (a lost peer, or those an abort by the caller names) join ``unwaited``, first cause or not."""
        with self._lock:
            self.unwaited |= gone_ranks(error)
            if self.aborted is None:
                self.aborted = error
            posted, self._posted = self._posted, {}
            early, self._unexpected = self._unexpected, {}
            inflight, self._inflight = self._inflight, {}
            lent, self._lent = self._lent, {}
            self._early_bytes.clear()
        for req, _ in lent.values():
            req.complete(self.aborted)
        for req in inflight.values():
            req.complete(self.aborted)
        for p in posted.values():
            p.req.complete(self.aborted)
        for e in early.values():
            if e.waiter is not None:
                e.waiter.req.complete(self.aborted)


class Spares:
    """Memory of early frames whose payload has been copied out, kept for the next early frames: a large
    message whose receive is posted late (a peer a step ahead) then costs one copy, not an allocation whose
    pages the kernel must also find and zero. At most ``KEEP`` buffers of ``MAX_BYTES`` in all are kept;
    only memory this rank allocated for its own bounded early frames comes here. Thread-safe."""

    KEEP = 4
    MAX_BYTES = 64 << 20
    SMALL = 1 << 16  # smaller frames are allocated afresh: cheap, and not worth holding memory for

    def __init__(self) -> None:
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """Memory for ``nbytes`` (its contents are not cleared)."""
        if nbytes >= self.SMALL and self._free:
            with self._lock:
                for i, buf in enumerate(self._free):
                    if nbytes <= len(buf) <= 2 * nbytes:
                        return self._free.pop(i)[:nbytes]
        return np.empty(nbytes, np.uint8).data if nbytes >= self.SMALL else memoryview(bytearray(nbytes))

    def give(self, data: memoryview) -> None:
        """``data`` (from ``take``) is no longer read by anyone."""
        if len(data) < self.SMALL:
            return
        whole = memoryview(data.obj)  # the whole buffer a take() cut it from
        with self._lock:
            if len(self._free) < self.KEEP and sum(map(len, self._free)) + len(whole) <= self.MAX_BYTES:
                self._free.append(whole)


def as_bytes(arr: np.ndarray) -> memoryview:
    return arr.data.cast("B")

