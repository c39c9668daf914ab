"""eRDMA messages over QUIC streams, sans-IO: which bytes go on which stream, and how a peer's streams
become mailbox deliveries. No sockets, no clock, no asyncio.

Every message travels on unidirectional streams of its own, so a lost packet stalls only the message it
belongs to. A message larger than ``part_bytes`` is cut into parts, each on its own stream. A stream carries
one prefix and then its bytes, and ends (FIN) with them::

    kind    B  1 = HELLO (then the 32-byte wire HELLO), 2 = PART (then the 44-byte wire FRAME header)
    offset  Q  where this part's bytes start in the message's payload
    length  Q  how many payload bytes follow on this stream

Every part repeats the frame header, so whichever part arrives first asks the mailbox where the payload goes.
Streams complete in any order: the transport contract's "frames in order" reduces to the one thing the core
relies on, that BYE comes after the data: a BYE carries in ``seq`` the number of DATA frames its sender sent,
and the peer counts as gone only once that many have landed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from erdma_core.errors import PeerLostError, ProtocolError
from erdma_core.mailbox import Mailbox
from erdma_core.wire import ABORT, BYE, DATA, FRAME, HELLO, Header, Hello, abort_error

PREFIX = struct.Struct("<BQQ")
KIND_HELLO, KIND_PART = 1, 2
_HEAD = {KIND_HELLO: HELLO.size, KIND_PART: FRAME.size}
MAX_CONTROL_BYTES = 1 << 16


def message_parts(header: Header, payload: memoryview | bytes, part_bytes: int) -> list[tuple[bytes, memoryview]]:
    """The streams one message needs: ``(prefix and header, payload slice)`` for each."""
    n = header.nbytes
    view = memoryview(payload).cast("B") if not isinstance(payload, bytes) else memoryview(payload)
    if len(view) != n:
        raise ProtocolError(f"frame header says {n} payload bytes, the buffer holds {len(view)}")
    count = max(1, -(-n // part_bytes))
    step = -(-n // count) if n else 0
    head = header.pack()
    out = []
    for i in range(count):
        lo, hi = i * step, min(n, (i + 1) * step)
        out.append((PREFIX.pack(KIND_PART, lo, hi - lo) + head, view[lo:hi]))
    return out


def hello_stream(hello: Hello) -> bytes:
    return PREFIX.pack(KIND_HELLO, 0, 0) + hello.pack()


class _Frame:
    __slots__ = ("buf", "remaining", "token")

    def __init__(self, buf: memoryview | None, token: object, remaining: int) -> None:
        self.buf, self.token, self.remaining = buf, token, remaining


class _Stream:
    __slots__ = ("body", "end", "frame", "head", "key", "kind", "pos")

    def __init__(self) -> None:
        self.head = bytearray()
        self.key = (0, 0, 0)
        self.kind = 0
        self.frame: _Frame | None = None
        self.body: bytearray | None = None  # HELLO, ABORT and BYE payloads are collected whole
        self.pos = self.end = 0


class Inbound:
    """One peer's incoming streams, reassembled into mailbox deliveries.

    ``feed`` takes what QUIC delivered on a stream (in stream order, as QUIC guarantees per stream).
    ``on_hello(hello)`` is called for a HELLO stream; DATA frames go to the mailbox; ABORT aborts it; BYE
    marks the peer gone once every frame it announced has landed. Malformed input raises ProtocolError.
    """

    def __init__(self, rank: int, peer: int, mailbox: Mailbox, on_hello: Callable[[Hello], None]) -> None:
        self.rank, self.peer, self.mailbox, self.on_hello = rank, peer, mailbox, on_hello
        self._streams: dict[int, _Stream] = {}
        self._frames: dict[tuple[int, int, int], _Frame] = {}
        self.completed = 0  # DATA frames fully landed
        self.bye_after: int | None = None  # the peer said BYE after sending this many DATA frames
        self.closed_cleanly = False  # its BYE came and everything before it landed

    def feed(self, stream_id: int, data: bytes, fin: bool) -> None:
        st = self._streams.get(stream_id)
        if st is None:
            st = self._streams[stream_id] = _Stream()
        view = memoryview(data)
        if st.frame is None and st.body is None:
            view = self._read_head(st, view)
        if len(view):
            if st.pos + len(view) > st.end:
                raise ProtocolError(f"rank {self.peer} sent {st.pos + len(view) - st.end} bytes past the end of a part")
            if st.body is not None:
                st.body += view
            elif st.frame is not None:
                self._land(st, view)
            st.pos += len(view)
        if fin:
            del self._streams[stream_id]
            if st.pos != st.end or (st.frame is None and st.body is None):
                raise ProtocolError(f"rank {self.peer} ended a stream after {st.pos} of {st.end} bytes")
            if st.body is not None:
                self._control(st)

    def _read_head(self, st: _Stream, view: memoryview) -> memoryview:
        while True:
            if st.head and st.head[0] not in _HEAD:
                raise ProtocolError(f"rank {self.peer} opened a stream of unknown kind {st.head[0]}")
            need = PREFIX.size + _HEAD[st.head[0]] if st.head else 1
            if len(st.head) >= need:
                break
            take = min(len(view), need - len(st.head))
            if take == 0:
                return view
            st.head += view[:take]
            view = view[take:]
        st.kind, offset, length = PREFIX.unpack_from(st.head)
        st.pos, st.end = offset, offset + length
        if st.kind == KIND_HELLO:
            if length != 0:
                raise ProtocolError(f"rank {self.peer} sent a HELLO stream with {length} extra bytes")
            st.body = bytearray(st.head[PREFIX.size:])
            return view
        h = Header.parse(st.head[PREFIX.size:])
        st.key = h.key
        if offset + length > h.nbytes:
            raise ProtocolError(f"rank {self.peer} sent part [{offset}, {offset + length}) of a {h.nbytes}-byte frame")
        if h.kind != DATA:
            if offset != 0 or length != h.nbytes or length > MAX_CONTROL_BYTES:
                raise ProtocolError(f"rank {self.peer} sent a control frame of {h.nbytes} bytes in parts")
            st.body = bytearray()
            return view
        fr = self._frames.get(h.key)
        if fr is None:
            buf, token = self.mailbox.on_header(self.peer, h)
            fr = self._frames[h.key] = _Frame(buf, token, h.nbytes)
        st.frame = fr
        if h.nbytes == 0:
            self._finish(h.key, fr)
        return view

    def _land(self, st: _Stream, view: memoryview) -> None:
        fr = st.frame
        assert fr is not None
        if fr.buf is not None:
            fr.buf[st.pos:st.pos + len(view)] = view
        fr.remaining -= len(view)
        if fr.remaining == 0:
            self._finish(st.key, fr)

    def _finish(self, key: tuple[int, int, int], fr: _Frame) -> None:
        del self._frames[key]
        self.mailbox.on_payload(fr.token)
        self.completed += 1
        self._maybe_gone()

    def _control(self, st: _Stream) -> None:
        assert st.body is not None
        if st.kind == KIND_HELLO:
            self.on_hello(Hello.parse(bytes(st.body)))
            return
        h = Header.parse(st.head[PREFIX.size:])
        if h.kind == ABORT:
            self.mailbox.abort(abort_error(self.rank, self.peer, bytes(st.body)))
        elif h.kind == BYE:
            self.bye_after = h.seq
            self._maybe_gone()

    def _maybe_gone(self) -> None:
        if self.bye_after is not None and self.completed >= self.bye_after:
            self.mailbox.peer_gone(self.peer, PeerLostError(
                f"rank {self.rank}: rank {self.peer} closed its process group", peer=self.peer, rank=self.rank))
            self.bye_after = None
            self.closed_cleanly = True
