"""Frames arriving from one peer, sans-IO: ``FrameInbox`` gives each frame's payload a place (the mailbox
for data, a small buffer for ABORT and BYE) and acts on it once it is in; ``StreamReader`` cuts a byte
stream into frames without copying payloads (the I/O adapter reads straight into the buffer it is handed).
No sockets, no threads, no clock.
"""

from __future__ import annotations

from typing import NamedTuple

from cryptography.hazmat.primitives.ciphers import AEADEncryptionContext

from ..errors import IntegrityError, PeerLostError, ProtocolError
from ..security.integrity import PIECE, SEAL, Checker, trailer
from ..wire import ABORT, BYE, DATA, FRAME, LENT, MAX_PAYLOAD, PULL, PULLED, Header, abort_error
from .mailbox import Lent, Mailbox, Token

_STAGE = 1 << 16  # bytes read at a time between large payloads
DIRECT_BYTES = 1 << 15  # a payload with at least this much left is read straight into its place
_NO_BODY = bytearray()  # a data frame's body goes to the mailbox, not here


class Landing(NamedTuple):
    """``FrameInbox.frame``'s token: the frame's header, the mailbox's token (a data frame's) and the
    buffer a control frame's body is read into (empty for a data frame)."""

    header: Header
    token: Token
    body: bytearray


class FrameInbox:
    """One peer's frames: ``frame(header)`` returns ``(buffer, token)`` (read the ``header.nbytes`` payload
    bytes into ``buffer``; None: read and drop them), then ``landed(token)`` once they are in. Data frames
    go to the mailbox; an ABORT aborts it with the peer's reason; a BYE (which says how many data frames
    came before it) marks the peer gone once that many have landed, whatever order they completed in.
    A PULL (a data frame the peer lends, ``single_copy``) goes to the mailbox as such, and so does a PULLED
    (the peer has read a send of ours). When the peer's frames come over several connections (a pool),
    each has an inbox of its own and its own BYE, and they share one ``Pool``: the peer is gone once every
    one of them has closed cleanly."""

    __slots__ = ("bye_after", "closed_cleanly", "completed", "mailbox", "peer", "pool", "rank")

    def __init__(self, rank: int, peer: int, mailbox: Mailbox) -> None:
        self.rank, self.peer, self.mailbox = rank, peer, mailbox
        self.completed = 0  # data frames fully landed
        self.bye_after: int | None = None
        self.closed_cleanly = False  # its BYE came and everything before it landed
        self.pool: Pool | None = None  # the inboxes of the peer's other connections, when it has several

    def frame(self, h: Header) -> tuple[memoryview | None, Landing]:
        if h.kind == DATA:
            buf, token = self.mailbox.frame(self.peer, h)
            return buf, Landing(h, token, _NO_BODY)
        if h.job & 0xFFFFFFFF != self.mailbox.job32:
            raise ProtocolError(f"rank {self.rank}: control frame from rank {self.peer} carries job {h.job:#x}, "
                                f"this job is {self.mailbox.job32:#x}")
        body = bytearray(h.nbytes)  # ABORT/BYE: Header.parse bounds them to MAX_CONTROL_BYTES
        return memoryview(body), Landing(h, None, body)

    def whole(self, h: Header, payload: memoryview) -> None:
        """A whole frame at once: ``frame``, the copy and ``landed`` in one call."""
        if h.kind == DATA:
            self.mailbox.whole(self.peer, h, payload)
            self.completed += 1
            if self.bye_after is not None:
                self._maybe_gone()
            return
        buf, token = self.frame(h)
        if buf is not None and h.nbytes:
            buf[:h.nbytes] = payload
        self.landed(token)

    def landed(self, landing: Landing) -> None:
        h, token, body = landing
        if h.kind == DATA:
            self.mailbox.landed(token)
            self.completed += 1
            self._maybe_gone()
        elif h.kind == ABORT:
            self.mailbox.aborted_by(self.peer, abort_error(self.rank, self.peer, bytes(body)))
        elif h.kind == BYE:
            self.bye_after = h.seq
            self._maybe_gone()
        elif h.kind == PULL:
            address, nbytes, ticket = LENT.unpack(body)
            if nbytes > MAX_PAYLOAD:
                raise ProtocolError(f"rank {self.rank}: rank {self.peer} lent a message of {nbytes} bytes")
            self.mailbox.lent(self.peer, h._replace(kind=DATA, nbytes=nbytes), Lent(address, ticket))
            self.completed += 1
            self._maybe_gone()
        elif h.kind == PULLED:
            self.mailbox.returned(self.peer, h.seq)

    def _maybe_gone(self) -> None:
        if self.bye_after is not None and self.completed >= self.bye_after:
            self.bye_after = None
            self.closed_cleanly = True
            if self.pool is not None and not self.pool.closed():
                return  # frames may still be landing on the peer's other connections
            self.mailbox.peer_gone(self.peer, PeerLostError(
                f"rank {self.rank}: rank {self.peer} closed its process group", peer=self.peer, rank=self.rank))


class Pool:
    """The connections one peer's frames come over, counted down as each closes cleanly (its BYE came and
    every frame it announced landed). Only the thread that reads the connections touches it."""

    __slots__ = ("open",)

    def __init__(self, inboxes: list[FrameInbox]) -> None:
        self.open = len(inboxes)
        for inbox in inboxes:
            inbox.pool = self

    def closed(self) -> bool:
        """One more connection closed cleanly; True once all have."""
        self.open -= 1
        return self.open == 0


class StreamReader:
    """Frames from a byte stream (TCP, Unix sockets): the I/O adapter reads into ``buffer()``
    (``sock.recv_into``) and reports how many bytes arrived with ``advance(n)``. Headers and small payloads
    are read into a staging buffer, several frames at a time when they came together (one system call
    instead of two per message); a large payload whose receive is already posted is read straight into the
    receiver's memory. After a large frame only the next header is read at first, so that a stream of large
    frames (the chunks of a big message) is never copied through the stage. ``between_frames`` tells a
    clean end of stream from one cut in the middle of a frame. Malformed headers raise ProtocolError.

    With a ``check`` (``integrity.Checker``) every frame is sealed: a header is acted on only once its tag
    is checked, and a frame lands (its receive completes) only once its payload's is; a large payload is
    read at most ``integrity.PIECE`` bytes at a time and tagged piece by piece while it is in the cache. A
    failed check raises ``IntegrityError``; the reader then drops whatever else comes on the stream."""

    __slots__ = ("_big", "_broken", "_check", "_counter", "_done", "_have", "_head", "_left", "_piece", "_stage",
                 "_start", "_stream", "_sv", "_tail", "_target", "_token", "inbox")

    def __init__(self, inbox: FrameInbox, check: Checker | None = None) -> None:
        self.inbox = inbox
        self._check = check
        self._head = FRAME.size + (SEAL.size if check is not None else 0)  # header (and seal) before a payload
        self._piece = PIECE if check is not None else MAX_PAYLOAD  # payload bytes read straight in at a time
        self._stream: AEADEncryptionContext | None = None  # the tag of the payload being read, so far
        self._counter = 0  # that frame's counter
        self._tail = 0  # bytes after that payload (its tag)
        self._broken = False  # a check failed: nothing more is taken from this stream
        self._stage = bytearray(_STAGE)
        self._sv = memoryview(self._stage)
        self._start = self._have = 0  # staged bytes not consumed yet: _stage[_start:_start + _have]
        self._token: Landing | None = None  # the frame whose payload is being read
        self._target: memoryview | None = None  # where its payload goes (None: dropped)
        self._left = self._done = 0
        self._big = False  # the last frame was large: read the next header alone

    @property
    def between_frames(self) -> bool:
        return self._token is None and self._have == 0

    @property
    def direct(self) -> bool:
        """``buffer()`` is a payload's own place (or scratch for a payload nobody receives): bytes written at
        its start and reported with one ``advance`` go there. It stays so while at least ``DIRECT_BYTES`` of
        the payload are left before an ``advance``; an adapter may let bytes land there as they arrive and
        report them later in one ``advance``, as long as that many were left (erdma-dpdk does)."""
        return self._token is not None and self._have == 0 and self._left >= DIRECT_BYTES

    def buffer(self) -> memoryview:
        if self._broken:
            return self._sv
        if self.direct:
            if self._target is not None:
                return self._target[self._done:self._done + self._piece]  # straight into the receiver's memory
            return self._sv[:min(_STAGE, self._left)]  # dropped: through the stage, not kept
        if self._start:
            self._stage[:self._have] = self._stage[self._start:self._start + self._have]
            self._start = 0
        if self._big and self._token is None and self._have < self._head:
            return self._sv[self._have:self._head]
        return self._sv[self._have:]

    def advance(self, n: int) -> None:
        if self._broken:
            return
        try:
            self._advance(n)
        except IntegrityError:
            self._broken = True
            raise

    def _advance(self, n: int) -> None:
        if self.direct:
            if self._stream is not None:  # tagged while the bytes are in the cache (dropped ones too)
                target = self._target
                self._stream.authenticate_additional_data(target[self._done:self._done + n] if target is not None
                                                          else self._sv[:n])
            self._done += n
            self._left -= n
            if self._left == 0 and not self._tail:
                self._land(None)
            return
        self._have += n
        head = self._head
        while True:
            if self._token is not None:
                take = min(self._left, self._have)
                if take:
                    start = self._start
                    if self._target is not None:
                        self._target[self._done:self._done + take] = self._sv[start:start + take]
                    if self._stream is not None:
                        self._stream.authenticate_additional_data(self._sv[start:start + take])
                    self._done += take
                    self._left -= take
                    self._consume(take)
                if self._left or self._have < self._tail:
                    return
                tag = self._sv[self._start:self._start + self._tail]
                self._consume(self._tail)  # the stage is not written until this returns
                self._land(tag)
            elif self._have >= head:
                start = self._start
                check = self._check
                counter = check.header(self._sv[start:start + head]) if check is not None else 0
                h = Header.parse(self._sv[start:start + FRAME.size])
                nbytes = h.nbytes
                tail = trailer(nbytes) if check is not None else 0
                self._big = nbytes >= DIRECT_BYTES
                if self._have - head >= nbytes + tail:  # the whole frame is staged (small frames): land it now
                    self._consume(head + nbytes + tail)  # the stage is not written until this returns
                    end = start + head + nbytes
                    payload = self._sv[start + head:end]
                    if tail:
                        check.payload(counter, payload, self._sv[end:end + tail])  # type: ignore[union-attr]
                    self.inbox.whole(h, payload)
                    continue
                buf, token = self.inbox.frame(h)
                self._consume(head)
                self._token, self._left, self._done = token, nbytes, 0
                self._target = buf[:nbytes] if buf is not None else None
                self._tail, self._counter = tail, counter
                if tail:
                    self._stream = check.stream(counter)  # type: ignore[union-attr]
            else:
                return

    def _consume(self, n: int) -> None:
        self._start += n
        self._have -= n
        if self._have == 0:
            self._start = 0

    def _land(self, tag: memoryview | None) -> None:
        token, stream = self._token, self._stream
        self._token = self._target = self._stream = None
        self._tail = 0
        if stream is not None:
            self._check.streamed(self._counter, stream, tag)  # type: ignore[union-attr,arg-type]
        self.inbox.landed(token)  # type: ignore[arg-type]  # (set while a frame is landing)
