"""Frames arriving from one peer, sans-IO: ``FrameInbox`` gives each frame's payload a place (the mailbox
for data, a small buffer for ABORT and BYE) and acts on it once it is in; ``StreamReader`` cuts a byte
stream into frames without copying payloads (the I/O adapter reads straight into the buffer it is handed).
No sockets, no threads, no clock.
"""

from __future__ import annotations

from ..errors import PeerLostError, ProtocolError
from .mailbox import Mailbox
from .wire import ABORT, BYE, DATA, FRAME, Header, abort_error

_DISCARD = 1 << 20


class FrameInbox:
    """One peer's frames: ``frame(header)`` returns ``(buffer, token)`` (read the ``header.nbytes`` payload
    bytes into ``buffer``; None: read and drop them), then ``landed(token)`` once they are in. Data frames
    go to the mailbox; an ABORT aborts it with the peer's reason; a BYE (which says how many data frames
    came before it) marks the peer gone once that many have landed, whatever order they completed in."""

    __slots__ = ("bye_after", "closed_cleanly", "completed", "mailbox", "peer", "rank")

    def __init__(self, rank: int, peer: int, mailbox: Mailbox) -> None:
        self.rank, self.peer, self.mailbox = rank, peer, mailbox
        self.completed = 0  # data frames fully landed
        self.bye_after: int | None = None
        self.closed_cleanly = False  # its BYE came and everything before it landed

    def frame(self, h: Header) -> tuple[memoryview | None, object]:
        if h.kind == DATA:
            buf, token = self.mailbox.on_header(self.peer, h)
            return buf, (h, token)
        if h.job & 0xFFFFFFFF != self.mailbox.job32:
            raise ProtocolError(f"rank {self.rank}: control frame from rank {self.peer} carries job {h.job:#x}, "
                                f"this job is {self.mailbox.job32:#x}")
        body = bytearray(h.nbytes)  # ABORT/BYE: Header.parse bounds them to MAX_CONTROL_BYTES
        return memoryview(body), (h, body)

    def landed(self, token: object) -> None:
        h, rest = token  # type: ignore[misc]
        if h.kind == DATA:
            self.mailbox.on_payload(rest)
            self.completed += 1
            self._maybe_gone()
        elif h.kind == ABORT:
            self.mailbox.abort(abort_error(self.rank, self.peer, bytes(rest)))
        elif h.kind == BYE:
            self.bye_after = h.seq
            self._maybe_gone()

    def _maybe_gone(self) -> None:
        if self.bye_after is not None and self.completed >= self.bye_after:
            self.bye_after = None
            self.closed_cleanly = True
            self.mailbox.peer_gone(self.peer, PeerLostError(
                f"rank {self.rank}: rank {self.peer} closed its process group", peer=self.peer, rank=self.rank))


class StreamReader:
    """Frames from a byte stream (TCP, Unix sockets), without copying payloads: the I/O adapter reads
    into ``buffer()`` (``sock.recv_into``) and reports how many bytes arrived with ``advance(n)``. A
    payload whose receive is already posted lands in the receiver's memory. ``between_frames`` tells a
    clean end of stream from one cut in the middle of a frame. Malformed headers raise ProtocolError."""

    __slots__ = ("_discard", "_done", "_got", "_head", "_head_view", "_left", "_target", "_token", "inbox")

    def __init__(self, inbox: FrameInbox) -> None:
        self.inbox = inbox
        self._head = bytearray(FRAME.size)
        self._head_view = memoryview(self._head)
        self._got = 0  # header bytes read
        self._token: object = None  # the frame whose payload is being read
        self._target: memoryview | None = None
        self._left = self._done = 0
        self._discard: memoryview | None = None

    @property
    def between_frames(self) -> bool:
        return self._got == 0 and self._token is None

    def buffer(self) -> memoryview:
        if self._token is None:
            return self._head_view[self._got:]
        if self._target is not None:
            return self._target[self._done:]
        if self._discard is None:
            self._discard = memoryview(bytearray(_DISCARD))
        return self._discard[:min(_DISCARD, self._left)]

    def advance(self, n: int) -> None:
        if self._token is None:
            self._got += n
            if self._got < FRAME.size:
                return
            self._got = 0
            h = Header.parse(self._head)
            buf, token = self.inbox.frame(h)
            if h.nbytes == 0:
                self.inbox.landed(token)
                return
            self._token, self._left, self._done = token, h.nbytes, 0
            self._target = buf[:h.nbytes] if buf is not None else None
            return
        self._left -= n
        self._done += n
        if self._left == 0:
            token, self._token, self._target = self._token, None, None
            self.inbox.landed(token)
