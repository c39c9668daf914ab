"""eRDMA messages over QUIC streams, sans-IO: which bytes go on which stream, and how a peer's streams
become mailbox deliveries. No sockets, no clock, no asyncio.

Every message travels on unidirectional streams of its own, so a lost packet stalls only the message it
belongs to. A message larger than ``part_bytes`` is cut into parts, each on its own stream. A stream carries
one prefix and then its bytes, and ends (FIN) with them::

    kind    B  1 = HELLO (then the 32-byte wire HELLO), 2 = PART (then the 64-byte wire FRAME header)
    number  Q  the part's number: 1, 2, 3 ... per direction of a pair of ranks, across its connections
    offset  Q  where this part's bytes start in the message's payload
    length  Q  how many payload bytes follow on this stream

Every part repeats the frame header, so whichever part arrives first asks where the payload goes.
A part counts once its stream has ended; the numbers let a peer that reconnects send again every part QUIC
had not acknowledged, and the receiver drop the ones it already has (``Inbound.reset`` forgets the streams of
the connection that ended). Streams complete in any order; the core's ``FrameInbox`` (what each frame means:
data for the mailbox, ABORT, BYE after the data it announced) needs none.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Protocol

from erdma_core.sdk import Header, ProtocolError
from erdma_core.toolkit import DATA, FRAME, HELLO, MAX_CONTROL_BYTES, FrameInbox, Hello

PREFIX = struct.Struct("<BQQQ")
KIND_HELLO, KIND_PART = 1, 2
_HEAD = {KIND_HELLO: HELLO.size, KIND_PART: FRAME.size}
_NUMBER = struct.Struct("<Q")


def message_parts(header: Header, payload: memoryview | bytes, part_bytes: int) -> list[tuple[bytes, memoryview]]:
    """The streams one message needs: ``(prefix and header, payload slice)`` for each, numbered 0 until
    ``numbered`` gives each its number as it is sent."""
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
        out.append((PREFIX.pack(KIND_PART, 0, lo, hi - lo) + head, view[lo:hi]))
    return out


def numbered(head: bytes, number: int) -> bytes:
    """A part's prefix and header with its number filled in."""
    return head[:1] + _NUMBER.pack(number) + head[1 + _NUMBER.size:]


HEAD_BYTES = PREFIX.size + FRAME.size  # a part's stream begins with these: what says where its payload goes


def hello_stream(hello: Hello) -> bytes:
    return PREFIX.pack(KIND_HELLO, 0, 0, 0) + hello.pack()


class _Frame:
    __slots__ = ("base", "buf", "remaining", "token")

    def __init__(self, buf: memoryview | None, token: object, remaining: int, base: int = 0) -> None:
        self.buf, self.token, self.remaining = buf, token, remaining
        self.base = base  # payload offset of buf[0]: 0 for a whole frame, the part's offset for a lone part


class PartSink(Protocol):
    """Where a striping lane's parts go instead of a mailbox (``lanes``): each part whole, on its own."""

    def open_part(self, peer: int, head: bytes, length: int) -> tuple[memoryview, object]:
        """A part begins: ``head`` is its prefix and frame header; return a buffer of ``length`` bytes."""
        ...

    def part_landed(self, token: object) -> None: ...


class _Stream:
    __slots__ = ("end", "frame", "head", "hello", "key", "number", "pos", "shared", "skip", "start")

    def __init__(self) -> None:
        self.head = bytearray()
        self.key = (0, 0, 0)
        self.number = 0
        self.frame: _Frame | None = None
        self.shared = False  # the frame's parts may arrive on several streams (data frames)
        self.hello: bytearray | None = None
        self.pos = self.end = self.start = 0
        self.skip = False  # a part that already landed over an earlier connection: read and drop


class Inbound:
    """One peer's incoming streams, reassembled into frames for the core's ``FrameInbox``.

    ``feed`` takes what QUIC delivered on a stream (in stream order, as QUIC guarantees per stream).
    ``on_hello(hello)`` is called for a HELLO stream; every other frame goes to ``frames``. With ``frames``
    None (a peer not yet identified) only HELLO is accepted. With a ``sink`` (a striping lane's connection,
    which carries only some parts of each frame) every data part goes to the sink whole, and the rank's main
    connection to the peer puts it in place with ``land`` (``frames`` is None there). Malformed input raises
    ProtocolError.
    """

    def __init__(self, peer: int, frames: FrameInbox | None, on_hello: Callable[[Hello], None],
                 sink: PartSink | None = None) -> None:
        self.peer, self.frames, self.on_hello, self.sink = peer, frames, on_hello, sink
        self._streams: dict[int, _Stream] = {}
        self._frames: dict[tuple[int, int, int], _Frame] = {}
        self._landed: set[int] = set()  # part numbers at or above _below that have landed
        self._below = 1  # every part numbered below this has landed
        self.duplicates = 0  # parts that came again after a reconnection and were dropped

    @property
    def completed(self) -> int:
        """Data frames fully landed."""
        return self.frames.completed if self.frames is not None else 0

    @property
    def closed_cleanly(self) -> bool:
        return self.frames is not None and self.frames.closed_cleanly

    def reset(self) -> None:
        """The connection ended: forget its half-read streams (their parts will come again, whole)."""
        self._streams.clear()

    def feed(self, stream_id: int, data: bytes, fin: bool) -> None:
        st = self._streams.get(stream_id)
        if st is None:
            st = self._streams[stream_id] = _Stream()
        view = memoryview(data)
        if st.frame is None and st.hello is None and not st.skip:
            view = self._read_head(st, view)
        if len(view):
            if st.pos + len(view) > st.end:
                raise ProtocolError(f"rank {self.peer} sent {st.pos + len(view) - st.end} bytes past the end of a part")
            if st.hello is not None:
                st.hello += view
            elif st.frame is not None and st.frame.buf is not None:
                at = st.pos - st.frame.base
                st.frame.buf[at:at + len(view)] = view
            st.pos += len(view)
        if fin:
            self._end(stream_id, st)

    def target(self, stream_id: int) -> memoryview | None:
        """Where the rest of a stream whose head was fed belongs (the slice of its frame's buffer), so that an
        engine can put it there itself and then say ``placed``; None: feed it (a HELLO, a part dropped as
        already landed, a frame with no buffer, a stream whose head is not all in)."""
        st = self._streams.get(stream_id)
        if st is None or st.frame is None or st.frame.buf is None or st.pos == st.end:
            return None
        at = st.pos - st.frame.base
        view = st.frame.buf[at:at + st.end - st.pos]
        return view if len(view) == st.end - st.pos else None

    def placed(self, stream_id: int) -> None:
        """The rest of the stream went into ``target``'s buffer, and the stream ended."""
        st = self._streams.get(stream_id)
        if st is None or st.frame is None:
            raise ProtocolError(f"rank {self.peer}: stream {stream_id} landed in place with no frame under way")
        st.pos = st.end
        self._end(stream_id, st)

    def _end(self, stream_id: int, st: _Stream) -> None:
        del self._streams[stream_id]
        if st.pos != st.end or (st.frame is None and st.hello is None and not st.skip):
            raise ProtocolError(f"rank {self.peer} ended a stream after {st.pos} of {st.end} bytes")
        if st.skip:
            return
        if st.hello is not None:
            self.on_hello(Hello.parse(bytes(st.hello)))
            return
        self._mark(st.number)
        assert st.frame is not None
        if self.sink is not None:
            self.sink.part_landed(st.frame.token)
            return
        st.frame.remaining -= st.end - st.start
        if st.frame.remaining == 0:
            self._finish(st.key if st.shared else None, st.frame)

    def land(self, head: bytes, payload: memoryview) -> None:
        """A data part that came whole over a striping lane (prefix and header, then its bytes): copy it
        into its frame's buffer; the frame completes when its last part, from any lane, has landed."""
        if self.frames is None or len(head) != PREFIX.size + FRAME.size:
            raise ProtocolError(f"rank {self.peer} sent a part over a lane before it was identified")
        kind, _, offset, length = PREFIX.unpack_from(head)
        h = Header.parse(head[PREFIX.size:])
        if kind != KIND_PART or h.kind != DATA or len(payload) != length or offset + length > h.nbytes:
            raise ProtocolError(f"rank {self.peer} sent a malformed part over a lane: kind {kind}/{h.kind}, "
                                f"[{offset}, {offset + length}) of {h.nbytes} bytes, {len(payload)} received")
        fr = self._frame(h)
        if fr.buf is not None:
            fr.buf[offset:offset + length] = payload
        fr.remaining -= length
        if fr.remaining == 0:
            self._finish(h.key, fr)

    def _mark(self, number: int) -> None:
        self._landed.add(number)
        while self._below in self._landed:
            self._landed.discard(self._below)
            self._below += 1

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
        kind, st.number, offset, length = PREFIX.unpack_from(st.head)
        st.pos = st.start = offset
        st.end = offset + length
        if kind == KIND_HELLO:
            if length != 0:
                raise ProtocolError(f"rank {self.peer} sent a HELLO stream with {length} extra bytes")
            st.hello = bytearray(st.head[PREFIX.size:])
            return view
        if self.frames is None and self.sink is None:
            raise ProtocolError(f"rank {self.peer} sent a message before it was identified")
        if st.number == 0:
            raise ProtocolError(f"rank {self.peer} sent a part without a number")
        h = Header.parse(st.head[PREFIX.size:])
        st.key = h.key
        if offset + length > h.nbytes:
            raise ProtocolError(f"rank {self.peer} sent part [{offset}, {offset + length}) of a {h.nbytes}-byte frame")
        if st.number < self._below or st.number in self._landed:
            st.skip = True
            self.duplicates += 1
            return view
        if h.kind != DATA:
            if self.sink is not None or self.frames is None:
                raise ProtocolError(f"rank {self.peer} sent a control frame over a striping lane")
            if offset != 0 or length != h.nbytes or length > MAX_CONTROL_BYTES:
                raise ProtocolError(f"rank {self.peer} sent a control frame of {h.nbytes} bytes in parts")
            buf, token = self.frames.frame(h)
            st.frame = _Frame(buf, token, length)
            return view
        if self.sink is not None:
            buf, token = self.sink.open_part(self.peer, bytes(st.head), length)
            st.frame = _Frame(buf, token, length, base=offset)
            return view
        st.frame, st.shared = self._frame(h), True
        return view

    def _frame(self, h: Header) -> _Frame:
        assert self.frames is not None
        fr = self._frames.get(h.key)
        if fr is None:
            buf, token = self.frames.frame(h)
            fr = self._frames[h.key] = _Frame(buf, token, h.nbytes)
        return fr

    def _finish(self, key: tuple[int, int, int] | None, fr: _Frame) -> None:
        assert self.frames is not None
        if key is not None:
            del self._frames[key]
        self.frames.landed(fr.token)


# The ALPN each engine announces: the engine and its framing, so that ranks on different engines never complete
# a handshake (the transport says why before they try: ``QuicTransport._same_engine``)
ALPNS = {"aioquic": "erdma-aioquic/1", "ngtcp2": "erdma-ngtcp2/1"}
NO_APPLICATION_PROTOCOL = 0x178  # QUIC's CRYPTO_ERROR for TLS alert 120 (RFC 9001 4.8)


def close_reason(code: int, phrase: str | None) -> str:
    """Why a connection was closed, as the close said it; a failed ALPN says what it most often means."""
    if phrase:
        return phrase
    if code == NO_APPLICATION_PROTOCOL:
        return (f"error code {code:#x}: TLS no_application_protocol (the peer speaks another ALPN: another "
                "transport.quic.engine or erdma-quic version, or not eRDMA)")
    return f"error code {code:#x}"
